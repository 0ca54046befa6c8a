"""Mutation score of the modules whose bugs would be silent (ordering, resume, cache, manifest, packing).

    python benchmarks/mutation.py [--modules order partition state] [--out bench_out/mutation.json]
                                  [--jobs 1] [--show-survivors] [--sample N --seed S] [--only order:12 ...]

A small self-written AST mutator, not mutmut: mutmut 3 copies the tree into `mutants/` and maps a
file to a module by its path, but `loaders/order/epochs.py` is installed as `shardkit.loaders.order.epochs`
(package-dir mapping), so its trampolines never load; and it re-runs each test in a fresh process,
where importing torch alone costs seconds on this machine. Here a parent process imports the heavy
dependencies once, then forks one child per mutant; the child puts a finder first on `sys.meta_path`
that serves the mutated module under its real name and runs pytest on that module's own test files
(`-x`, slow tests deselected, hypothesis derandomized). Nothing on disk changes, so an interrupted run
leaves the tree clean.

Operators (as mutmut's): comparison flips (< <=, > >=, == !=, is / is not, in / not in), arithmetic and
augmented assignment (+ -, * /, // /, % /, ** *, & |, << >>), and / or, removing `not` and unary minus,
number constants n -> n + 1, True <-> False, break <-> continue. Not mutated: strings (messages),
docstrings, annotations, logging calls and f-strings.

A child that spawns processes (DataLoader workers) runs the unmutated module there, so mutants only
those tests would kill count as survivors: the figures are a lower bound. A mutant that hangs is
killed by the timeout (5 x the clean run + 10 s) and counted apart. A benchmark, not part of CI.
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib.abc
import importlib.util
import json
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# file -> (module name, test files that exercise it). Only the relevant tests, so a run is minutes.
TARGETS: dict[str, tuple[str, str, list[str]]] = {
    "order": ("loaders/order/epochs.py", "shardkit.loaders.order.epochs",
              ["tests/test_order.py", "tests/test_partition.py", "tests/test_mixing.py"]),
    "partition": ("loaders/order/partition.py", "shardkit.loaders.order.partition",
                  ["tests/test_partition.py", "tests/test_mixing.py", "tests/test_dataloader.py",
                   "tests/test_dataloader_resume.py"]),
    "state": ("loaders/state/loader_state.py", "shardkit.loaders.state.loader_state",
              ["tests/test_dataloader.py", "tests/test_dataloader_resume.py"]),
    "cache": ("loaders/cache/shard_cache.py", "shardkit.loaders.cache.shard_cache",
              ["tests/test_cache.py", "tests/test_cache_security.py", "tests/test_blocks.py", "tests/test_decoded.py"]),
    "cache_dir": ("loaders/cache/directory.py", "shardkit.loaders.cache.directory",
                  ["tests/test_cache.py", "tests/test_cache_security.py", "tests/test_blocks.py"]),
    "decoded_store": ("loaders/cache/decoded_store.py", "shardkit.loaders.cache.decoded_store",
                      ["tests/test_cache.py", "tests/test_cache_security.py", "tests/test_blocks.py",
                       "tests/test_decoded.py"]),
    "memory_stores": ("loaders/cache/memory_stores.py", "shardkit.loaders.cache.memory_stores",
                      ["tests/test_cache.py", "tests/test_blocks.py"]),
    "block_reader": ("loaders/cache/block_reader.py", "shardkit.loaders.cache.block_reader", ["tests/test_blocks.py"]),
    "shard_blocks": ("loaders/cache/shard_blocks.py", "shardkit.loaders.cache.shard_blocks", ["tests/test_blocks.py"]),
    "block_completion": ("loaders/cache/block_completion.py", "shardkit.loaders.cache.block_completion",
                         ["tests/test_blocks.py"]),
    "manifest": ("shardkit/manifest.py", "shardkit.manifest",
                 ["tests/test_manifest.py", "tests/test_manifest_index.py"]),
    "packing": ("shardkit/text/packing.py", "shardkit.text.packing", ["tests/test_packing.py"]),
}

COMPARE_SWAP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
                ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
BINOP_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
              ast.Mod: ast.Div, ast.Pow: ast.Mult, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd,
              ast.LShift: ast.RShift, ast.RShift: ast.LShift}


@dataclass
class Mutant:
    module: str
    index: int
    line: int
    change: str
    source_line: str
    outcome: str = "pending"  # killed | timeout | survived
    seconds: float = 0.0


def _is_logging_call(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id in ("logger", "logging", "log"))


class _Mutator(ast.NodeTransformer):
    """Counts mutation sites in a fixed visiting order; applies site number `target` (if >= 0)."""

    def __init__(self, target: int = -1):
        self.target = target
        self.sites: list[tuple[int, str]] = []

    def _site(self, node: ast.AST, change: str) -> bool:
        self.sites.append((getattr(node, "lineno", 0), change))
        return len(self.sites) - 1 == self.target

    # -- skipped zones ----------------------------------------------------------------------------
    def visit_Expr(self, node):
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return node  # docstring
        if _is_logging_call(node.value):
            return node
        return self.generic_visit(node)

    def visit_JoinedStr(self, node):
        return node

    def visit_AnnAssign(self, node):
        if node.value is not None:
            node.value = self.visit(node.value)
        return node

    def visit_arg(self, node):
        return node

    def _visit_function(self, node):
        node.returns = node.returns  # annotations stay as they are
        for name in ("args", "body", "decorator_list"):
            value = getattr(node, name)
            setattr(node, name, self.visit(value) if isinstance(value, ast.AST) else
                    [self.visit(v) for v in value])
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = _visit_function

    def visit_arguments(self, node):
        node.defaults = [self.visit(d) for d in node.defaults]
        node.kw_defaults = [self.visit(d) if d is not None else None for d in node.kw_defaults]
        return node

    # -- operators --------------------------------------------------------------------------------
    def visit_Compare(self, node):
        node = self.generic_visit(node)
        for i, op in enumerate(node.ops):
            new = COMPARE_SWAP.get(type(op))
            if new and self._site(node, f"{type(op).__name__} -> {new.__name__}"):
                node.ops[i] = new()
        return node

    def visit_BinOp(self, node):
        node = self.generic_visit(node)
        new = BINOP_SWAP.get(type(node.op))
        if new and self._site(node, f"{type(node.op).__name__} -> {new.__name__}"):
            node.op = new()
        return node

    def visit_AugAssign(self, node):
        node = self.generic_visit(node)
        new = BINOP_SWAP.get(type(node.op))
        if new and self._site(node, f"{type(node.op).__name__}= -> {new.__name__}="):
            node.op = new()
        return node

    def visit_BoolOp(self, node):
        node = self.generic_visit(node)
        new = ast.Or if isinstance(node.op, ast.And) else ast.And
        if self._site(node, f"{type(node.op).__name__} -> {new.__name__}"):
            node.op = new()
        return node

    def visit_UnaryOp(self, node):
        node = self.generic_visit(node)
        if isinstance(node.op, (ast.Not, ast.USub)) and self._site(node, f"drop {type(node.op).__name__}"):
            return node.operand
        return node

    def visit_Constant(self, node):
        value = node.value
        if isinstance(value, bool):
            if self._site(node, f"{value} -> {not value}"):
                return ast.copy_location(ast.Constant(not value), node)
        elif isinstance(value, (int, float)) and self._site(node, f"{value!r} -> {value + 1!r}"):
            return ast.copy_location(ast.Constant(value + 1), node)
        return node

    def visit_Break(self, node):
        if self._site(node, "break -> continue"):
            return ast.copy_location(ast.Continue(), node)
        return node

    def visit_Continue(self, node):
        if self._site(node, "continue -> break"):
            return ast.copy_location(ast.Break(), node)
        return node


def list_mutants(name: str) -> tuple[ast.Module, list[Mutant]]:
    path, _, _ = TARGETS[name]
    text = (REPO / path).read_text()
    tree = ast.parse(text)
    counter = _Mutator()
    counter.visit(copy.deepcopy(tree))
    lines = text.splitlines()
    return tree, [Mutant(name, i, line, change, lines[line - 1].strip() if line else "")
                  for i, (line, change) in enumerate(counter.sites)]


class _MutantFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves one module from a mutated AST under its real name (first on sys.meta_path)."""

    def __init__(self, fullname: str, path: Path, tree: ast.Module):
        self.fullname, self.path, self.code = fullname, path, compile(tree, str(path), "exec")

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.fullname:
            return None
        return importlib.util.spec_from_loader(fullname, self, origin=str(self.path))

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__file__ = str(self.path)
        exec(self.code, module.__dict__)  # noqa: S102 - our own source, mutated


def _child(name: str, tree: ast.Module | None, log: Path) -> None:
    """Runs in the forked child: install the mutant, run the module's tests, exit with pytest's code."""
    os.setsid()  # own process group: a timeout kills the child and anything it spawned
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    path, fullname, tests = TARGETS[name]
    if tree is not None:
        sys.meta_path.insert(0, _MutantFinder(fullname, REPO / path, ast.fix_missing_locations(tree)))
    import pytest
    from hypothesis import Phase, settings

    # Derandomized hypothesis and no example database: a mutant's fate must not depend on the last one.
    # No shrinking: a failing example already kills the mutant, and shrinking it costs seconds each.
    settings.register_profile("mutation", derandomize=True, database=None,
                              phases=[Phase.explicit, Phase.reuse, Phase.generate])
    settings.load_profile("mutation")
    os.chdir(REPO)
    tests = [t for t in tests if (REPO / t).exists()]  # a listed test file may not exist yet
    code = pytest.main([*tests, "-x", "-q", "-p", "no:cacheprovider", "-m", "not slow", "-W", "ignore"])
    os._exit(int(code))


def _start(name: str, tree: ast.Module | None, log: Path) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            _child(name, tree, log)
        finally:
            os._exit(70)
    return pid


def _wait(pid: int, timeout: float) -> tuple[int | None, float]:
    """Exit code of `pid` (None on timeout, after killing its process group) and the seconds taken."""
    start = time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), time.monotonic() - start
        if time.monotonic() - start > timeout:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None, time.monotonic() - start
        time.sleep(0.05)


def _preload() -> None:
    """Import the heavy dependencies once in the parent, so each forked child starts in milliseconds."""
    for module in ("numpy", "torch", "pytest", "hypothesis", "pyarrow", "pyarrow.parquet", "zstandard", "fsspec",
                   "torch.utils.data", "torch.distributed"):
        try:
            __import__(module)
        except ImportError:
            pass
    if any(m.startswith("shardkit") for m in sys.modules):
        raise RuntimeError("shardkit was imported before forking: the mutants would not be loaded")


def choose(mutants: list[Mutant], sample: int | None, seed: int, only: set[int] | None) -> list[Mutant]:
    """The mutants to run: all, the listed indices, or a deterministic sample of `sample` (by `seed`)."""
    if only is not None:
        return [m for m in mutants if m.index in only]
    if sample is None or sample >= len(mutants):
        return mutants
    picked = set(random.Random(seed).sample(range(len(mutants)), sample))
    return [m for m in mutants if m.index in picked]


def run_module(name: str, jobs: int, logs: Path, sample: int | None = None, seed: int = 0,
               only: set[int] | None = None) -> tuple[list[Mutant], int, float]:
    """Runs the chosen mutants of `name`; returns them, the number of mutation sites, the clean seconds."""
    tree, every = list_mutants(name)
    mutants = choose(every, sample, seed, only)
    clean_code, clean_seconds = _wait(_start(name, None, logs / f"{name}-clean.log"), 1800)
    if clean_code != 0:
        raise RuntimeError(f"{name}: the unmutated tests fail (exit {clean_code}); see {logs / f'{name}-clean.log'}")
    timeout = 5 * clean_seconds + 10
    pending = list(mutants)
    running: dict[int, tuple[Mutant, float]] = {}
    while pending or running:
        while pending and len(running) < jobs:
            mutant = pending.pop(0)
            mutator = _Mutator(mutant.index)
            mutated = mutator.visit(copy.deepcopy(tree))
            pid = _start(name, mutated, logs / f"{name}-{mutant.index}.log")
            running[pid] = (mutant, time.monotonic())
        for pid, (mutant, started) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            elapsed = time.monotonic() - started
            if not done and elapsed <= timeout:
                continue
            if not done:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                mutant.outcome = "timeout"
            else:
                code = os.waitstatus_to_exitcode(status)
                # 0: every test passed. Anything else (a failure, or a collection error because the
                # mutant broke the import) means the tests noticed.
                mutant.outcome = "survived" if code == 0 else "killed"
                if mutant.outcome == "killed":
                    (logs / f"{name}-{mutant.index}.log").unlink(missing_ok=True)
            mutant.seconds = round(elapsed, 2)
            del running[pid]
            print(f"  {name}:{mutant.index:<4} line {mutant.line:<4} {mutant.change:<22} {mutant.outcome:<8} {elapsed:5.1f}s  "
                  f"{mutant.source_line[:60]}", flush=True)
        time.sleep(0.05)
    return mutants, len(every), clean_seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modules", nargs="+", choices=list(TARGETS), default=list(TARGETS))
    parser.add_argument("--out", default=None, help="JSON report (default bench_out/mutation.json; with --only "
                        "bench_out/mutation_only.json, so a check of a few mutants never replaces a module's row)")
    parser.add_argument("--jobs", type=int, default=1, help="mutants tested at once (the machine is shared)")
    parser.add_argument("--show-survivors", action="store_true", help="list every survivor after the table")
    parser.add_argument("--sample", type=int, default=None,
                        help="run a deterministic sample of N mutants per module (the table says how many of all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of --sample")
    parser.add_argument("--only", nargs="+", default=None, metavar="MODULE:INDEX",
                        help="run only these mutants (e.g. order:12, to check that a new test kills a survivor)")
    args = parser.parse_args(argv)
    only: dict[str, set[int]] = {}
    for item in args.only or []:
        module, _, index = item.partition(":")
        if module not in TARGETS or not index.isdigit():
            parser.error(f"--only {item!r}: expected MODULE:INDEX with MODULE one of {list(TARGETS)}")
        only.setdefault(module, set()).add(int(index))
    if only:
        args.modules = [m for m in args.modules if m in only] if args.modules != list(TARGETS) else list(only)
    _preload()
    out = Path(args.out or REPO / "bench_out" / ("mutation_only.json" if only else "mutation.json"))
    logs = out.parent / "mutation_logs"
    logs.mkdir(parents=True, exist_ok=True)
    report: dict[str, dict] = {}
    all_mutants: list[Mutant] = []
    started = time.monotonic()
    for name in args.modules:
        print(f"{name}: {TARGETS[name][0]} with {' '.join(TARGETS[name][2])}", flush=True)
        mutants, sites, clean = run_module(name, args.jobs, logs, args.sample, args.seed, only.get(name))
        all_mutants += mutants
        counts = {k: sum(m.outcome == k for m in mutants) for k in ("killed", "timeout", "survived")}
        total = len(mutants)
        report[name] = {"file": TARGETS[name][0], "tests": TARGETS[name][2], "mutants": total, "sites": sites,
                        "selection": ("all" if total == sites else f"only {sorted(only[name])}" if name in only
                                      else f"sample {args.sample} of {sites}, seed {args.seed}"),
                        **counts,
                        "score": round((counts["killed"] + counts["timeout"]) / total, 4) if total else None,
                        "clean_test_seconds": round(clean, 2), "seconds": round(time.monotonic() - started, 1)}
        # Written after each module, so an interrupted run keeps the modules it finished.
        _write_report(out, {name: report[name]}, [m for m in mutants if m.outcome == "survived"])
    print(f"\n{'module':<10} {'file':<22} {'mutants':>7} {'of':>5} {'killed':>7} {'timeout':>7} {'survived':>8} "
          f"{'score':>6}")
    for name, row in report.items():
        print(f"{name:<10} {row['file']:<22} {row['mutants']:>7} {row['sites']:>5} {row['killed']:>7} "
              f"{row['timeout']:>7} {row['survived']:>8} {row['score']:>6.1%}")
    if args.show_survivors:
        print("\nsurvivors:")
        for m in all_mutants:
            if m.outcome == "survived":
                print(f"  {m.module}:{m.index:<4} {TARGETS[m.module][0]}:{m.line}  {m.change:<22} {m.source_line}")
    print(f"\nwrote {out} ({time.monotonic() - started:.0f} s)")


def _write_report(out: Path, rows: dict[str, dict], survivors: list[Mutant]) -> None:
    """Replace these modules' rows and survivors in the JSON report, keeping the other modules'."""
    previous = json.loads(out.read_text()) if out.exists() else {}
    kept = [s for s in previous.get("survivors", []) if s["module"] not in rows]
    out.write_text(json.dumps({"modules": {**previous.get("modules", {}), **rows},
                               "survivors": kept + [asdict(m) for m in survivors]}, indent=1))


if __name__ == "__main__":
    main()
