"""The house rules of ../shared/STYLE.md, read from the source with `ast` (every import, also inside functions).

- The core (`shardkit/*.py`, `shardkit/formats/`) imports no other part.
- The build side (`tools/` = `shardkit.tools`) uses the core only; the loaders (`loaders/` = `shardkit.loaders`)
  likewise: the two never import each other, and neither imports the trainer.
- The trainer (`shardkit/train/`) uses the loaders and the core, by their modules (not the lazy face).
- The framework integrations (`shardkit/integrations/`) sit with the face: they use the loaders and the core,
  and nothing but the face imports them.
- Only the face (`shardkit/__init__.py`, `shardkit/__main__.py`, `shardkit/cli/`) and the tuner, which drives
  trainer runs, import the trainer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import shardkit

REPO = Path(__file__).resolve().parents[1]
LAZY = "shardkit (a lazy name of the face)"
LAZY_NAMES = set(shardkit._LAZY_NAMES)

# Part -> the parts it may import (itself included).
ALLOWED = {
    "core": {"core"},
    "build": {"core", "build"},
    "loaders": {"core", "loaders"},
    "trainer": {"core", "loaders", "trainer"},
    "integrations": {"core", "loaders", "integrations"},
    "tune": {"core", "trainer", "tune"},
    "face": {"core", "build", "loaders", "trainer", "tune", "integrations", "face"},
}


def part_of_module(module: str) -> str | None:
    """The part a `shardkit...` module name belongs to; None for modules outside shardkit."""
    if module == LAZY:
        return "face"
    names = module.split(".")
    if names[0] != "shardkit":
        return None
    if len(names) == 1:
        return "face"  # `from shardkit import X` goes through the lazy face
    return {"tools": "build", "loaders": "loaders", "train": "trainer", "tune": "tune", "integrations": "integrations", "cli": "face",
            "__main__": "face"}.get(names[1], "core")


def source_files() -> dict[Path, str]:
    """Every source file of the package -> the dotted name of its module."""
    roots = {REPO / "shardkit": "shardkit", REPO / "loaders": "shardkit.loaders", REPO / "tools": "shardkit.tools"}
    files = {}
    for root, package in roots.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            module = ".".join([package, *parts])
            if module.startswith("shardkit.loaders") and root.name == "shardkit":
                continue  # not a real path; loaders/ lives at the top
            files[path] = module
    return files


def imported_modules(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name == "shardkit":
                # `from shardkit import X`: X is a part (`train`), a lazily re-exported name of the face
                # (`StreamingDataset`), or a plain attribute of the package root (`__version__`).
                found.extend((node.lineno, LAZY if alias.name in LAZY_NAMES else f"shardkit.{alias.name}")
                             for alias in node.names)
            else:
                found.append((node.lineno, name))
    return found


def violations() -> list[str]:
    problems = []
    for path, module in source_files().items():
        own = part_of_module(module)
        for line, imported in imported_modules(path, module):
            target = part_of_module(imported)
            if target is None:
                continue
            if own != "face" and imported == LAZY:
                problems.append(f"{path.relative_to(REPO)}:{line}: {own} imports through the lazy face "
                                "(`from shardkit import ...`); import the defining module")
            elif own != "face" and target == "face":
                problems.append(f"{path.relative_to(REPO)}:{line}: {own} imports the CLI ({imported})")
            elif target not in ALLOWED[own]:
                problems.append(f"{path.relative_to(REPO)}:{line}: {own} imports {target} ({imported})")
    return problems


def test_every_import_follows_the_house_rules():
    assert violations() == []


def test_the_parts_are_where_the_design_card_puts_them():
    modules = set(source_files().values())
    assert {"shardkit.cli.main", "shardkit.manifest", "shardkit.loaders.dataset", "shardkit.tools.build",
            "shardkit.train.loop", "shardkit.integrations.huggingface"} <= modules
    parts = {part_of_module(m) for m in modules}
    assert {"core", "build", "loaders", "trainer", "integrations", "face"} <= parts


@pytest.mark.parametrize("importer, line, expected", [
    ("loaders/cache.py", "from shardkit.tools.tokenizers import load_tokenizer", "loaders imports build"),
    ("tools/build.py", "import shardkit.loaders.order", "build imports loaders"),
    ("shardkit/manifest.py", "from shardkit.train import loop", "core imports trainer"),
    ("shardkit/formats/reader.py", "from ..cli.dataset import describe", "core imports the CLI"),
    ("shardkit/train/data.py", "from shardkit import StreamingDataset", "imports through the lazy face"),
    ("loaders/state.py", "from shardkit import train", "loaders imports trainer"),
    ("shardkit/integrations/batches.py", "from shardkit.train import loop", "integrations imports trainer"),
    ("loaders/dataset.py", "import shardkit.integrations.batches", "loaders imports integrations"),
])
def test_a_violation_is_reported_with_its_place(tmp_path, monkeypatch, importer, line, expected):
    # The checker itself must catch each kind of violation: add one import to a copy of a real module.
    original = (REPO / importer).read_text()
    copy = {**source_files()}
    path = REPO / importer
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: original + f"\n{line}\n" if self == path
                        else Path.read_bytes(self).decode())
    found = violations()
    assert any(expected in problem and problem.startswith(importer) for problem in found), found
    assert copy == source_files()


# -- a feature is an operator, not a branch in a hub (issue 23: a shard store per cache mode, chosen once) --
# (file, function) where a loaders module may decide by `cache_mode`: the store factory, and the option's own
# check in LoaderConfig.
MODE_DECISIONS_ALLOWED = {("loaders/cache.py", "make_store"), ("loaders/config.py", "__post_init__")}


def _mentions_cache_mode(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "cache_mode" or isinstance(n, ast.Attribute)
               and n.attr == "cache_mode" for n in ast.walk(node))


def cache_mode_decisions(sources: dict[str, str]) -> list[str]:
    """`file:line in function` of every comparison, lookup or match by a `cache_mode` outside the allowed places."""
    found = []
    for name, text in sources.items():
        tree = ast.parse(text)
        functions = [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in ast.walk(tree):
            decided = (isinstance(node, ast.Compare) and _mentions_cache_mode(node)
                       or isinstance(node, ast.Subscript) and _mentions_cache_mode(node.slice)
                       or isinstance(node, ast.Match) and _mentions_cache_mode(node.subject)
                       or isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                       and node.func.attr == "get" and any(_mentions_cache_mode(a) for a in node.args))
            if not decided:
                continue
            inside = [f for f in functions if f.lineno <= node.lineno <= (f.end_lineno or f.lineno)]
            function = max(inside, key=lambda f: f.lineno).name if inside else "<module>"
            if (name, function) not in MODE_DECISIONS_ALLOWED:
                found.append(f"{name}:{node.lineno} in {function}")
    return found


def _loaders_sources() -> dict[str, str]:
    return {str(path.relative_to(REPO)): path.read_text() for path in sorted((REPO / "loaders").rglob("*.py"))}


def test_only_the_store_factory_decides_by_cache_mode():
    assert cache_mode_decisions(_loaders_sources()) == []


@pytest.mark.parametrize("line", ["if self.cache_mode == 'none': pass", "x = {'none': 1}[config.cache_mode]",
                                  "match cache_mode:\n    case 'none': pass", "x = STORES.get(cache_mode)"])
def test_a_decision_by_cache_mode_is_reported_with_its_place(line):
    sources = _loaders_sources()
    sources["loaders/reading.py"] += f"\n{line}\n"
    found = cache_mode_decisions(sources)
    assert len(found) == 1 and found[0].startswith("loaders/reading.py:") and found[0].endswith("in <module>"), found


# The data-parallel modes; a comparison with them outside shardkit/train/parallel/ is a layout question asked
# in the wrong place (the option's own checks in config.py validate --parallel, they decide no layout).
LAYOUT_MODES = {"none", "ddp", "fsdp", "hsdp", "diloco"}


def _is_layout_question(node: ast.AST) -> bool:
    if not isinstance(node, ast.Compare):
        return False
    sides = [node.left, *node.comparators]
    names = {n.attr if isinstance(n, ast.Attribute) else n.id for side in sides for n in ast.walk(side)
             if isinstance(n, (ast.Attribute, ast.Name))}
    constants = {n.value for side in sides for n in ast.walk(side) if isinstance(n, ast.Constant)}
    return bool(names & {"mode", "data_parallel"}) and bool(constants & LAYOUT_MODES)


def layout_questions(sources: dict[str, str]) -> list[str]:
    """`file:line` of every comparison of a parallel mode outside shardkit/train/parallel/ and config.py."""
    return [f"{name}:{node.lineno}" for name, text in sources.items() for node in ast.walk(ast.parse(text))
            if _is_layout_question(node)]


def _trainer_sources() -> dict[str, str]:
    root = REPO / "shardkit" / "train"
    return {str(path.relative_to(REPO)): path.read_text() for path in sorted(root.rglob("*.py"))
            if root / "parallel" not in path.parents and path.name != "config.py"}


def test_only_the_parallel_package_asks_about_the_layout():
    assert layout_questions(_trainer_sources()) == []
    sources = _trainer_sources()
    sources["shardkit/train/loop.py"] += "\nenabled = run.runtime.mode not in ('fsdp', 'hsdp')\n"
    assert [place.split(":")[0] for place in layout_questions(sources)] == ["shardkit/train/loop.py"]
