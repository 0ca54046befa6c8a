"""The house rules of ../shared/STYLE.md, read from the source with `ast` (every import, also inside functions).

- The core (`shardkit/*.py`, `shardkit/formats/`) imports no other part.
- The text layer (`shardkit/text/` = `shardkit.text`: input readers, tokenizer specs, packers) uses the core only.
- The build side (`tools/` = `shardkit.tools`) uses the core and the text layer; the loaders (`loaders/` =
  `shardkit.loaders`) likewise: the two never import each other, and neither imports the trainer.
- The trainer (`shardkit/train/`) uses the loaders and the core, by their modules (not the lazy face).
- The data service (`shardkit/serve/`: dispatcher and workers) uses the loaders and the core; only the face imports it.
- The framework integrations (`shardkit/integrations/`) sit with the face: they use the loaders and the core,
  and nothing but the face imports them.
- Only the face (`shardkit/__init__.py`, `shardkit/__main__.py`, `shardkit/cli/`) and the tuner, which drives
  trainer runs, import the trainer.
- Only the store factory decides by `cache_mode`.
- A single file is written atomically by the core's one helper (`shardkit.storage.atomic_path`): no other
  module renames a file into place, except the two directory publishes (checkpoints, PBT).
- No import cycle between modules, also through imports inside functions (`test_no_import_cycle_between_modules`
  says which imports are not counted, and why).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable, Container
from pathlib import Path

import pytest

import shardkit

REPO = Path(__file__).resolve().parents[1]
LAZY = "shardkit (a lazy name of the face)"
LAZY_NAMES = set(shardkit._LAZY_NAMES)
_parsed = functools.lru_cache(maxsize=None)(ast.parse)  # one parse per text for all the checks of a module

# Part -> the parts it may import (itself included).
ALLOWED = {
    "core": {"core"},
    "text": {"core", "text"},
    "build": {"core", "text", "build"},
    "loaders": {"core", "text", "loaders"},
    "trainer": {"core", "loaders", "trainer"},
    "integrations": {"core", "loaders", "integrations"},
    "tune": {"core", "trainer", "tune"},
    "serve": {"core", "loaders", "serve"},
    "face": {"core", "text", "build", "loaders", "trainer", "tune", "integrations", "serve", "face"},
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
    return {"text": "text", "tools": "build", "loaders": "loaders", "train": "trainer", "tune": "tune",
            "integrations": "integrations", "serve": "serve", "cli": "face", "__main__": "face"}.get(names[1], "core")


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
            "shardkit.train.loop", "shardkit.integrations.huggingface", "shardkit.text.inputs",
            "shardkit.text.tokenizers", "shardkit.text.packing", "shardkit.text.documents"} <= modules
    parts = {part_of_module(m) for m in modules}
    assert {"core", "text", "build", "loaders", "trainer", "integrations", "face"} <= parts


def _add_line(monkeypatch, importer: str, line: str) -> None:
    """Make the checker read `importer` (a real module) with `line` added at its end."""
    path = REPO / importer
    original = path.read_text()
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: original + f"\n{line}\n" if self == path
                        else Path.read_bytes(self).decode())


@pytest.mark.parametrize("importer, line", [
    ("tools/build.py", "from shardkit.text.packing import make_packer"),
    ("loaders/dataset.py", "from shardkit.text.tokenizers import load_tokenizer"),
])
def test_both_sides_may_import_the_text_layer(monkeypatch, importer, line):
    _add_line(monkeypatch, importer, line)
    assert violations() == []


@pytest.mark.parametrize("importer, line, expected", [
    ("loaders/cache/shard_cache.py", "from shardkit.tools.build import run_build", "loaders imports build"),
    ("shardkit/text/packing.py", "from shardkit.tools.build import run_build", "text imports build"),
    ("shardkit/text/documents.py", "from shardkit.loaders.sources.built.reading import read_sample", "text imports loaders"),
    ("shardkit/manifest.py", "from shardkit.text.tokenizers import load_tokenizer", "core imports text"),
    ("tools/build.py", "import shardkit.loaders.order.epochs", "build imports loaders"),
    ("shardkit/manifest.py", "from shardkit.train import loop", "core imports trainer"),
    ("shardkit/formats/reader.py", "from ..cli.dataset import describe", "core imports the CLI"),
    ("shardkit/train/data.py", "from shardkit import StreamingDataset", "imports through the lazy face"),
    ("loaders/state/loader_state.py", "from shardkit import train", "loaders imports trainer"),
    ("shardkit/integrations/batches.py", "from shardkit.train import loop", "integrations imports trainer"),
    ("loaders/dataset.py", "import shardkit.integrations.batches", "loaders imports integrations"),
])
def test_a_violation_is_reported_with_its_place(tmp_path, monkeypatch, importer, line, expected):
    # The checker itself must catch each kind of violation: add one import to a copy of a real module.
    copy = {**source_files()}
    _add_line(monkeypatch, importer, line)
    found = violations()
    assert any(expected in problem and problem.startswith(importer) for problem in found), found
    assert copy == source_files()


# -- one option machine (issue 32): every command's options come from dataclass fields through shardkit/options.py --
# Only the machine touches argparse. The `shardkit` dispatcher (cli/main.py) and `python -m shardkit.train` build
# their top-level parsers through it too (`command_parser`, `add_subcommands`), so they need no exception.
OPTION_MACHINE = {"shardkit/options.py"}
PARSER_BUILDING = {"ArgumentParser", "OptionParser", "add_argument", "add_argument_group",
                   "add_mutually_exclusive_group", "add_parser", "add_subparsers"}


def argparse_outside_the_option_machine(sources: dict[str, str]) -> list[str]:
    """`file:line: what` of every argparse import and every parser-building call outside the option machine."""
    found = []
    for name, text in sources.items():
        if name in OPTION_MACHINE:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "argparse" for a in node.names) or (
                    isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "argparse"):
                found.append(f"{name}:{node.lineno}: imports argparse")
            elif isinstance(node, ast.Call):
                called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if called in PARSER_BUILDING:
                    found.append(f"{name}:{node.lineno}: calls {called}")
    return found


def _package_sources() -> dict[str, str]:
    """Every source file of the package, by its path in the repository -> its text."""
    return {str(path.relative_to(REPO)): path.read_text() for path in source_files()}


def test_no_argparse_outside_the_option_machine():
    assert argparse_outside_the_option_machine(_package_sources()) == []


@pytest.mark.parametrize("line, what", [
    ("import argparse", "imports argparse"), ("from argparse import Namespace", "imports argparse"),
    ("parser.add_argument('--metrics-port', type=int)", "calls add_argument"),
    ("group = parser.add_argument_group('x')", "calls add_argument_group"),
    ("p = OptionParser(prog='x')", "calls OptionParser"),
])
def test_hand_built_options_are_reported_with_their_place(line, what):
    sources = _package_sources()
    sources["shardkit/cli/build.py"] += f"\n{line}\n"
    found = argparse_outside_the_option_machine(sources)
    assert len(found) == 1 and found[0].startswith("shardkit/cli/build.py:") and found[0].endswith(what), found


# -- a feature is an operator, not a branch in a hub (issue 23: a shard store per cache mode, chosen once) --
# (file, function) where a loaders module may decide by `cache_mode`: the store factory and its table, and the
# option's own check in LoaderConfig.
MODE_DECISIONS_ALLOWED = {("loaders/cache/shard_cache.py", "make_store"), ("loaders/cache/shard_cache.py", "keeps_node_files"),
                          ("loaders/cache/shard_cache.py", "_store_class"), ("loaders/config.py", "__post_init__")}


def _mentions_cache_mode(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "cache_mode" or isinstance(n, ast.Attribute)
               and n.attr == "cache_mode" for n in ast.walk(node))


def _function_at(nodes: list[ast.AST], line: int) -> str:
    """The name of the innermost function of `nodes` (a module's) that holds `line`; "<module>" if none."""
    inside = [f for f in nodes if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              and f.lineno <= line <= (f.end_lineno or f.lineno)]
    return max(inside, key=lambda f: f.lineno).name if inside else "<module>"


def places_outside(sources: dict[str, str], pick: Callable[[list[ast.AST]], list[ast.AST]],
                   allowed: Container[tuple[str, str]]) -> list[str]:
    """`file:line in function` of every node that `pick` takes from a module's nodes, outside the `allowed`
    (file, function) places."""
    found = []
    for name, text in sources.items():
        nodes = list(ast.walk(_parsed(text)))
        for node in pick(nodes):
            function = _function_at(nodes, node.lineno)
            if (name, function) not in allowed:
                found.append(f"{name}:{node.lineno} in {function}")
    return found


def _decides_by_cache_mode(node: ast.AST) -> bool:
    return (isinstance(node, ast.Compare) and _mentions_cache_mode(node)
            or isinstance(node, ast.Subscript) and _mentions_cache_mode(node.slice)
            or isinstance(node, ast.Match) and _mentions_cache_mode(node.subject)
            or isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get" and any(_mentions_cache_mode(a) for a in node.args))


def cache_mode_decisions(sources: dict[str, str]) -> list[str]:
    """`file:line in function` of every comparison, lookup or match by a `cache_mode` outside the allowed places."""
    return places_outside(sources, lambda nodes: [n for n in nodes if _decides_by_cache_mode(n)],
                          MODE_DECISIONS_ALLOWED)


def _loaders_sources() -> dict[str, str]:
    return {str(path.relative_to(REPO)): path.read_text() for path in sorted((REPO / "loaders").rglob("*.py"))}


def test_only_the_store_factory_decides_by_cache_mode():
    assert cache_mode_decisions(_loaders_sources()) == []


@pytest.mark.parametrize("line", ["if self.cache_mode == 'none': pass", "x = {'none': 1}[config.cache_mode]",
                                  "match cache_mode:\n    case 'none': pass", "x = STORES.get(cache_mode)"])
def test_a_decision_by_cache_mode_is_reported_with_its_place(line):
    sources = _loaders_sources()
    sources["loaders/sources/built/reading.py"] += f"\n{line}\n"
    found = cache_mode_decisions(sources)
    assert len(found) == 1 and found[0].startswith("loaders/sources/built/reading.py:") and found[0].endswith("in <module>"), found


# -- one atomic write for single files (issue 32) --
# (file, function) where a file or directory may be renamed into place: the core's one atomic write of a single
# file, and the two directory publishes (a `.partial` directory renamed to its final name once complete).
RENAMES_ALLOWED = {
    ("shardkit/storage.py", "atomic_path"): "the atomic write of a single file (temporary, fsync, rename)",
    ("shardkit/train/checkpoint.py", "_finish"): "publishes a training checkpoint: step_N.partial/ -> step_N/",
    ("shardkit/tune/pbt_checkpoints.py", "local"): "publishes a downloaded PBT checkpoint: NAME.partial/ -> NAME/",
}
_RENAMING_METHODS = {"rename", "renames", "mv", "move"}  # os.rename, Path.rename, fsspec's mv, shutil.move


def _renames_in(node: ast.Call, renaming_names: set[str]) -> bool:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id in renaming_names  # `from os import replace` and the like
    if not isinstance(func, ast.Attribute):
        return False
    if func.attr in _RENAMING_METHODS:
        return True
    if func.attr != "replace":
        return False
    if isinstance(func.value, ast.Name) and func.value.id == "os":
        return True
    # Path.replace(target): one argument, no keywords (str.replace takes two, dataclasses.replace keywords).
    return (len(node.args) == 1 and not node.keywords
            and not (isinstance(func.value, ast.Name) and func.value.id == "dataclasses"))


def _renaming_calls(nodes: list[ast.AST]) -> list[ast.AST]:
    renaming_names = {alias.asname or alias.name for node in nodes if isinstance(node, ast.ImportFrom)
                      and node.module in ("os", "shutil") for alias in node.names
                      if alias.name in ("replace", "rename", "renames", "move")}
    return [n for n in nodes if isinstance(n, ast.Call) and _renames_in(n, renaming_names)]


def renames(sources: dict[str, str]) -> list[str]:
    """`file:line in function` of every rename into place (os.replace, os.rename, Path.rename/replace, fsspec's
    mv, shutil.move) outside `RENAMES_ALLOWED`."""
    return places_outside(sources, _renaming_calls, RENAMES_ALLOWED)


def test_single_files_are_written_atomically_by_the_one_helper():
    """A file that must appear whole goes through `shardkit.storage.atomic_path` (or `write_file_atomic` on top
    of it), which names the temporary, fsyncs when asked and renames: no module renames a temporary of its own."""
    assert renames(_package_sources()) == []
    sources = _package_sources()
    for (name, function), why in RENAMES_ALLOWED.items():  # each allowed place still exists and renames
        tree = _parsed(sources[name])
        assert any(isinstance(f, ast.FunctionDef) and f.name == function and any(
            isinstance(n, ast.Call) and _renames_in(n, set()) for n in ast.walk(f)) for f in ast.walk(tree)), why


@pytest.mark.parametrize("line", [
    "def publish(tmp, path):\n    os.replace(tmp, path)",
    "def publish(tmp, path):\n    os.rename(tmp, path)",
    "def publish(tmp, path):\n    Path(tmp).replace(path)",
    "def publish(fs, tmp, path):\n    fs.mv(tmp, path)",
    "from os import replace as publish_file\npublish_file('a.tmp', 'a')",
])
def test_an_inline_rename_is_reported_with_its_place(line):
    sources = _package_sources()
    sources["loaders/cache/directory.py"] += f"\n{line}\n"
    found = renames(sources)
    assert len(found) == 1 and found[0].startswith("loaders/cache/directory.py:"), found


# -- no import cycle, even through imports inside functions (issue 32) --
def module_sources() -> dict[str, tuple[str, str]]:
    """Every module of the package -> (its file relative to the checkout, its text)."""
    return {module: (str(path.relative_to(REPO)), path.read_text()) for path, module in source_files().items()}


def import_graph(sources: dict[str, tuple[str, str]]) -> dict[str, dict[str, str]]:
    """Module -> {module it imports: `file:line` of the first such import}, from every import statement: at
    module level, inside functions, under `if TYPE_CHECKING:`.

    `from a.b import c` imports module `a.b.c` when there is one, else module `a.b`. A lazily exported name of a
    package (`_LAZY_NAMES`, PEP 562) is an import of the module that defines it, since that is what runs; the
    table itself is no import of the package. The packages above an imported module are no imports either
    (see `test_no_import_cycle_between_modules`).
    """
    lazy = {}  # package -> {lazily exported name: module that defines it}
    for module, (_, text) in sources.items():
        for node in _parsed(text).body:
            if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY_NAMES"
                                                     for t in node.targets)):
                lazy[module] = ast.literal_eval(node.value)
    graph = {}
    for module, (name, text) in sources.items():
        package = module if name.endswith("__init__.py") else module.rpartition(".")[0]
        edges = graph[module] = {}
        for node in ast.walk(_parsed(text)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in sources
                           else lazy.get(base, {}).get(alias.name, base) for alias in node.names]
            else:
                continue
            for target in targets:
                if target in sources and target != module:
                    edges.setdefault(target, f"{name}:{node.lineno}")
    return graph


def import_cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each as the imports
    inside it (`file:line: a imports b`)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                members = set(component)
                cycles.append(sorted(f"{where}: {a} imports {b}" for a in members
                                     for b, where in graph[a].items() if b in members))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_no_import_cycle_between_modules():
    """No two modules import each other, directly or through others, even by an import inside a function: such
    an import hides the cycle from the reader and from `import`'s order until the function runs.

    Two kinds of import are not counted, on principle:
    - The packages above an imported module (`import a.b.c` runs `a/__init__.py` and `a/b/__init__.py` first):
      a package is initialised before any of its modules, so a package that re-exports its own modules (such as
      `shardkit.formats`) cannot meet one of them half-initialised. An explicit import of a package
      (`from shardkit.formats import read_shard`) counts, and leads to the modules the package imports.
    - The lazy tables of the face and of `shardkit.loaders` (`_LAZY_NAMES`, resolved by a module-level
      `__getattr__` on a name's first use, once the package is initialised): `from shardkit import ShardWriter`
      counts as an import of `shardkit.formats.writer`, the module that runs, not of every module in the table.
    Dynamic imports (`importlib.import_module` with a computed name) are not seen.
    """
    assert import_cycles(import_graph(module_sources())) == []


@pytest.mark.parametrize("module, line, members", [
    ("shardkit.shard_columns", "def late():\n    from shardkit.manifest import Manifest",
     {"shardkit.manifest", "shardkit.shard_columns"}),
    ("shardkit.loaders.config", "def late():\n    from shardkit.loaders.order.partition import steps_in_epoch",
     {"shardkit.loaders.config", "shardkit.loaders.order.partition"}),
    ("shardkit.loaders.config", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .order import epochs",
     {"shardkit.loaders.config", "shardkit.loaders.order.epochs"}),
    ("shardkit.manifest", "def late():\n    from shardkit import ShardWriter",  # a lazy name of the face
     {"shardkit.manifest", "shardkit.formats.writer"}),
])
def test_an_import_cycle_is_reported_with_its_imports(module, line, members):
    sources = module_sources()
    name, text = sources[module]
    sources[module] = (name, text + f"\n{line}\n")
    cycles = import_cycles(import_graph(sources))
    assert len(cycles) == 1, cycles
    assert {m for entry in cycles[0] for m in entry.split(": ", 1)[1].split(" imports ")} == members, cycles
    # The added import is reported where it is (after the module's own lines).
    assert any(entry.startswith(f"{name}:") and int(entry.split(":")[1]) > len(text.splitlines())
               and entry.split(": ", 1)[1].startswith(f"{module} imports") for entry in cycles[0]), cycles
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


# -- loaders/ and tools/ import their own modules relatively (issue 32) --
# They install as shardkit.loaders and shardkit.tools, names no static tool or reader of the checkout can follow
# from the folder names; relative imports say where the module is.
SELF_NAMED = {"loaders": "shardkit.loaders", "tools": "shardkit.tools"}


def absolute_self_imports(sources: dict[str, str]) -> list[str]:
    """`file:line` of every import in loaders/ (tools/) that names its own package by its installed name."""
    found = []
    for name, text in sources.items():
        package = SELF_NAMED.get(name.split("/", 1)[0])
        if package is None:
            continue
        for node in ast.walk(_parsed(text)):
            modules = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(m == package or m.startswith(package + ".") for m in modules):
                found.append(f"{name}:{node.lineno}")
    return found


def test_loaders_and_tools_import_themselves_relatively():
    assert absolute_self_imports(_package_sources()) == []


@pytest.mark.parametrize("name, line", [
    ("loaders/cache/shard_cache.py", "from shardkit.loaders.order.epochs import Order"),
    ("loaders/cache/shard_cache.py", "def late():\n    import shardkit.loaders.order.epochs"),
    ("tools/build.py", "from shardkit.tools.config import BuildConfig"),
])
def test_an_absolute_self_import_is_reported_with_its_place(name, line):
    sources = _package_sources()
    sources[name] += f"\n{line}\n"
    found = absolute_self_imports(sources)
    assert len(found) == 1 and found[0].startswith(f"{name}:"), found


# Where issue 42 item 6's 60-line rule holds: the build side, and the trainer (its configuration in sections,
# and `loop.build`, which reads it, as named steps).
SIZE_RULED = ("tools", "shardkit/train")


def long_functions(paths: list[Path], *, limit: int = 60) -> list[str]:
    """`path:line: name is N lines` for each function of `paths` past `limit` lines (its `def` to its last line)."""
    return [f"{path.relative_to(REPO)}:{node.lineno}: {node.name} is {node.end_lineno - node.lineno + 1} lines"
            for path in paths for node in ast.walk(_parsed(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit]


def test_no_function_of_the_build_side_or_the_trainer_is_over_60_lines():
    """Issue 42 item 6: the build reads as named steps; a function past 60 lines (its `def` to its last line) is
    split into steps over one small object, as `tools/build.py`'s `prepare` / `emit` / `finish` are. The
    trainer is held to the same rule, and its configuration to modules under 400 lines (one per section)."""
    paths = sorted(path for folder in SIZE_RULED for path in (REPO / folder).rglob("*.py"))
    assert paths and (REPO / "shardkit/train/config/__init__.py") in paths and not (REPO / "shardkit/train/config.py").exists()
    assert long_functions(paths) == [], "split these into named steps"
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in paths
             if p.parent == REPO / "shardkit/train/config"}
    assert len(sizes) > 10
    assert {name: n for name, n in sizes.items() if n >= 400} == {}


def test_a_long_function_is_reported_with_its_place(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    (tmp_path / "long.py").write_text("def fine():\n    pass\n\n\ndef grown():\n" + "    x = 1\n" * 60)
    assert long_functions([tmp_path / "long.py"]) == ["long.py:5: grown is 61 lines"]


# -- the wings of loaders/ (docs/LOADING.md, "How the read side is put together") ----------------------------
WINGS = ("sources", "order", "cache", "state", "delivery")
# A source's modules that only its own wing may import (the rest of a source is its source, feed and mixture).
# `shardkit trace` asks `Source.provenance`, never the modules that answer it.
SOURCE_INTERNALS = ("shardkit.loaders.sources.raw.units", "shardkit.loaders.sources.raw.batches",
                    "shardkit.loaders.sources.raw.iteration", "shardkit.loaders.sources.built.batching",
                    "shardkit.loaders.sources.built.standalone", "shardkit.loaders.sources.built.feed",
                    "shardkit.loaders.sources.raw.provenance", "shardkit.loaders.sources.built.provenance",
                    "shardkit.loaders.sources.raw.worker_start", "shardkit.loaders.sources.built.engine",
                    "shardkit.loaders.sources.raw.engine", "shardkit.loaders.sources.mixture_lanes")


def wing_violations() -> list[str]:
    problems = []
    for path, module in source_files().items():
        where = f"{path.relative_to(REPO)}"
        wing = module.split(".")[2] if module.startswith("shardkit.loaders.") and module.count(".") >= 3 else None
        for line, imported in imported_modules(path, module):
            if wing in WINGS and imported in ("shardkit.loaders.dataset", "shardkit.loaders.dataloader"):
                problems.append(f"{where}:{line}: the {wing}/ wing imports the face ({imported})")
            if wing == "order" and imported.startswith(("shardkit.loaders.sources", "shardkit.loaders.cache")):
                problems.append(f"{where}:{line}: order/ reads no data, it imports {imported}")
            if imported in SOURCE_INTERNALS and not module.startswith("shardkit.loaders.sources"):
                problems.append(f"{where}:{line}: a source's internals ({imported}) imported from outside sources/")
    return problems


def test_the_wings_of_the_read_side_keep_their_rules():
    assert (REPO / "loaders" / "sources").is_dir() and not list((REPO / "loaders").glob("raw_*.py"))
    assert wing_violations() == []


def test_the_read_side_has_no_module_over_400_lines():
    # Issue 42 item 6: a module of loaders/ past 400 lines holds more than one job; split it by job, as
    # cache/block_reader.py (562 lines) became shard_blocks.py, block_completion.py and block_reader.py.
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in (REPO / "loaders").rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 400} == {}


def test_a_wing_violation_is_reported(monkeypatch):
    real = imported_modules

    def with_reach(path, module):
        found = real(path, module)
        if module == "shardkit.loaders.order.epochs":
            found = [*found, (1, "shardkit.loaders.cache.store")]
        return found

    monkeypatch.setitem(globals(), "imported_modules", with_reach)
    assert any("order/ reads no data" in p for p in wing_violations())
