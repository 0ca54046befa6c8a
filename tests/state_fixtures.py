"""Loader states written by a released loader, kept as fixtures (`tests/fixtures/loader_states/*.json`), and the data
they belong to, made again identically by every run.

A saved state is bound to its data: a built dataset by its shards' hashes (not their place), raw text and a
mixture's record also by the inputs' URLs. So the data is written, byte for byte the same, under one fixed folder
(`DATA_ROOT`, made once per machine under a lock: pytest-xdist's workers share it); the caches are per test.

Each case saves its loader's `state_dict()` after `BEFORE` batches and records the `AFTER` batches that followed
(sample ids; a raw batch's rows as (id, digest of the tokens): `resume_contract.batch_ids`). A fixture is made
with `python tests/state_fixtures.py` by the release whose states it keeps, never again afterwards:
`test_state_fixtures.py` loads each one into today's loader and requires exactly the recorded batches.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loader_helpers import write_fixed  # noqa: E402
from resume_contract import batch_ids  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "loader_states"
DATA_ROOT = Path(tempfile.gettempdir()) / "shardkit-state-fixtures-1"  # a new layout of the data: a new name
BEFORE, AFTER = 5, 4
WORDS = "the of and a to in is was he for it with as his on be at by had are but from or data text".split()
RAW = dict(tokenizer="byte", seq_len=64, unit_bytes=2048, lanes=5)


def _documents(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 200))) for _ in range(count)]


def _write_data(root: Path) -> None:
    """Two built datasets and a raw corpus (JSONL, JSONL.zst, and a .txt file) with a built stream for raw mixtures."""
    from shardkit.tools.build import run_build
    from shardkit.tools.config import BuildConfig

    write_fixed(str(root / "built_a"), 300, per_shard=64)
    write_fixed(str(root / "built_b"), 120, per_shard=50, offset=300)
    raw = root / "raw"
    raw.mkdir()
    lines = [json.dumps({"text": text}) for text in _documents(150, seed=1)]
    (raw / "a.jsonl").write_text("\n".join(lines[:90]) + "\n")
    (raw / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(("\n".join(lines[90:]) + "\n").encode()))
    (raw / "c.txt").write_text("\n\n".join(_documents(6, seed=2)))
    small = root / "small"
    small.mkdir()
    (small / "s.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in _documents(12, seed=3)))
    run_build(BuildConfig(inputs=(str(small),), output=str(root / "built_byte"), tokenizer="byte",
                          seq_len=RAW["seq_len"], shard_size=20_000, unit_bytes=4096, progress=False, workers=1))


def data_root() -> Path:
    """`DATA_ROOT`, written once (the first process to get here writes it; the others wait on the lock)."""
    DATA_ROOT.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{DATA_ROOT}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (DATA_ROOT / "done").exists():
            shutil.rmtree(DATA_ROOT, ignore_errors=True)
            DATA_ROOT.mkdir()
            _write_data(DATA_ROOT)
            (DATA_ROOT / "done").write_text("1")
    return DATA_ROOT


def _built(root: Path, cache: Path, *, workers: int = 0, mixture: bool = False):
    from shardkit.loaders import Stream, StreamingDataLoader, StreamingDataset

    source = ([Stream(str(root / "built_a"), 0.7), Stream(str(root / "built_b"), 0.3)] if mixture
              else str(root / "built_a"))
    dataset = StreamingDataset(source, cache_dir=str(cache), seed=3, rank=0, world_size=1)
    return StreamingDataLoader(dataset, batch_size=4, num_workers=workers,
                               multiprocessing_context="fork" if workers else None)


def _standalone(root: Path, cache: Path):
    """A dataset iterated without `StreamingDataLoader` (torchdata's StatefulDataLoader saves its `state_dict()`)."""
    from shardkit.loaders import StreamingDataset

    return StreamingDataset(str(root / "built_a"), cache_dir=str(cache), seed=3, rank=0, world_size=1, batch_size=4)


def _raw(root: Path, cache: Path, *, workers: int = 0, mixture: bool = False):
    from shardkit.loaders import Stream, StreamingDataLoader, StreamingDataset

    if mixture:
        dataset = StreamingDataset([Stream(str(root / "raw"), 0.6, raw_text=True), Stream(str(root / "built_byte"), 0.4)],
                                   cache_dir=str(cache), seed=5, rank=0, world_size=1, **RAW)
    else:
        dataset = StreamingDataset(str(root / "raw"), seed=5, rank=0, world_size=1, **RAW)
    return StreamingDataLoader(dataset, batch_size=3, num_workers=workers,
                               multiprocessing_context="fork" if workers else None)


# case name -> make_loader(data root, cache dir)
CASES: dict[str, Callable] = {
    "built": _built,
    "built_workers": lambda root, cache: _built(root, cache, workers=2),
    "built_mixture": lambda root, cache: _built(root, cache, mixture=True),
    "built_standalone": _standalone,
    "raw": _raw,
    "raw_workers": lambda root, cache: _raw(root, cache, workers=2),
    "raw_mixture": lambda root, cache: _raw(root, cache, mixture=True),
}


def rows(batches) -> list[list]:
    return [batch_ids(b).tolist() for b in batches]


def record(name: str, cache: Path) -> dict:
    """The case's state after `BEFORE` batches and the `AFTER` batches that follow it."""
    loader = CASES[name](data_root(), cache)
    batches = iter(loader)
    list(itertools.islice(batches, BEFORE))
    state = loader.state_dict()
    return {"case": name, "state": state, "next": rows(itertools.islice(batches, AFTER))}


def main() -> None:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as caches:
        for name in CASES:
            fixture = record(name, Path(caches) / name)
            (FIXTURES / f"{name}.json").write_text(json.dumps(fixture, indent=1, sort_keys=True) + "\n")
            print(f"wrote {FIXTURES / name}.json")
    os._exit(0)  # DataLoader workers' queues: nothing left to flush


if __name__ == "__main__":
    main()
