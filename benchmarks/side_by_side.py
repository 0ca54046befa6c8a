"""Issue 36's side-by-side table: shardkit (Arrow and tar) and every installed peer, in every column, in one run.

    python benchmarks/bench_loader.py --side-by-side [--tokens 10e6] [--shard-mb 4] [--runs 3]

The same samples (bench_loader's: 2,049 uniformly random uint16 tokens each) as shardkit Arrow and tar shards
(the writer's defaults: tar in the group layout) and as each peer's own format (benchmarks/peers.py: LitData,
MosaicML Streaming, WebDataset, Hugging Face datasets), chunks of --shard-mb for every reader. Columns, each
the median of --runs runs, every run from a fresh cache directory, batch 8, shuffle on:

- one pass, local, 0 and 2 DataLoader workers: samples/s over the whole pass (construction and first batch
  included) and the time to the first batch (construction included: "first batch, fresh");
- the same from S3 (a moto server on loopback, every reader through its own client);
- first batch after a resume at 50% of the epoch, local, 0 and 2 workers: a loader whose state was taken
  halfway through a pass is restored into a new loader over a fresh cache, timed from construction to its first
  batch (WebDataset has no resume: n/a).

Exactness, for every reader: each pass's sample indices (shardkit's `sample_id`, the peers' stored index)
are counted, and "each sample once" says whether every pass delivered every sample exactly once; the first
resume of each configuration runs to the end, and "resumed exactly" says whether the half before the state
and the rest after it together deliver every sample once.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

import peers

WORKERS = (0, 2)
RESUME_AT = 0.5


def shardkit_factory(cache_mode: str | None) -> Callable:
    """A peers-style factory `(url, batch, server, workers) -> make(cache)` for shardkit's loader."""
    def factory(url: str, batch: int, server=None, workers: int = 0) -> Callable[[str], Iterable[dict]]:
        from shardkit import StreamingDataLoader, StreamingDataset

        options = server.options if server is not None else None
        mode = {} if cache_mode is None else {"cache_mode": cache_mode}

        def make(cache: str):
            # "partial": the ragged end of the epoch as a smaller last batch, as the peers deliver it, so that
            # "every sample once" holds for every reader alike (the default drops it)
            dataset = StreamingDataset(url, cache_dir=cache, rank=0, world_size=1, storage_options=options,
                                       partial_batches="partial", **mode)
            return StreamingDataLoader(dataset, batch_size=batch, num_workers=workers)
        return make
    return factory


def indices_of(batch) -> np.ndarray:
    """The sample indices of one batch, whoever delivered it."""
    values = batch["sample_id"] if "sample_id" in batch else batch["index"]
    return np.asarray(values).reshape(-1)


def settle(loader) -> None:
    """After a run: let shardkit's background completions finish before the cache directory goes (other readers
    have nothing running once their iterator is dropped)."""
    for cache in getattr(getattr(loader, "dataset", None), "caches", ()):
        cache.drain()
    gc.collect()


def one_pass(make: Callable, samples: int) -> dict:
    cache = tempfile.mkdtemp(prefix="shardkit-bench-side-")
    try:
        start = time.perf_counter()
        loader = make(cache)
        iterator = iter(loader)
        seen = [indices_of(next(iterator))]
        first = time.perf_counter() - start
        seen += [indices_of(batch) for batch in iterator]
        elapsed = time.perf_counter() - start
        del iterator
        settle(loader)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    seen = np.concatenate(seen)
    return {"first_batch_s": first, "samples_per_s": len(seen) / elapsed, "exact": _exact(seen, samples)}


def resumed_first_batch(make: Callable, samples: int, batch: int, *, to_the_end: bool) -> dict:
    """Take the state halfway through a pass, restore it into a new loader over a fresh cache: the time from
    construction to its first batch; with `to_the_end`, whether both halves together are exact."""
    caches = [tempfile.mkdtemp(prefix="shardkit-bench-side-") for _ in range(2)]
    try:
        loader = make(caches[0])
        iterator = iter(loader)
        before = [indices_of(next(iterator)) for _ in range(int(samples / batch * RESUME_AT))]
        state = loader.state_dict()
        del iterator
        settle(loader)
        start = time.perf_counter()
        resumed = make(caches[1])
        resumed.load_state_dict(state)
        iterator = iter(resumed)
        after = [indices_of(next(iterator))]
        first = time.perf_counter() - start
        if to_the_end:
            after += [indices_of(b) for b in iterator]
        del iterator
        settle(resumed)
    finally:
        for cache in caches:
            shutil.rmtree(cache, ignore_errors=True)
    row = {"first_batch_s": first}
    if to_the_end:
        row["exact"] = _exact(np.concatenate(before + after), samples)
    return row


def _exact(seen: np.ndarray, samples: int) -> bool:
    return len(seen) == samples and np.array_equal(np.unique(seen), np.arange(samples))


def measure(label: str, make: Callable, samples: int, batch: int, runs: int, *, resume: bool) -> dict:
    """The medians of `runs` passes (and, with `resume`, of `runs` resumed first batches) of one configuration."""
    passes = [one_pass(make, samples) for _ in range(runs)]
    row = {"samples_per_s": statistics.median(p["samples_per_s"] for p in passes),
           "first_batch_s": statistics.median(p["first_batch_s"] for p in passes),
           "runs": [round(p["samples_per_s"]) for p in passes], "exact": all(p["exact"] for p in passes)}
    if resume:
        try:
            resumes = [resumed_first_batch(make, samples, batch, to_the_end=i == 0) for i in range(runs)]
        except Exception as err:  # noqa: BLE001 - a peer whose resume fails gets that in its cell, the run goes on
            row["resume_error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:200]
        else:
            row["resume_first_batch_s"] = statistics.median(r["first_batch_s"] for r in resumes)
            row["resume_runs"] = [round(r["first_batch_s"], 4) for r in resumes]
            row["resumed_exactly"] = resumes[0]["exact"]
    resumed = (f"  resumed {row['resume_first_batch_s']:.3f} s, exact {row['resumed_exactly']}"
               if "resume_first_batch_s" in row else f"  resume failed: {row['resume_error']}" if resume else "")
    print(f"  {label:<62} {row['samples_per_s']:>9,.0f} samples/s  first batch {row['first_batch_s']:.3f} s"
          f"  exact {row['exact']}{resumed}", flush=True)
    return row


def side_by_side(args) -> dict:
    from bench_loader import SEQ, MotoServer, build_arrow_copy, build_data

    data_dir, shard_bytes = Path(args.data_dir), args.shard_mb * 2**20
    tar_url, flat, samples = build_data(data_dir, int(args.tokens), shard_bytes)
    readers = {"shardkit Arrow": (build_arrow_copy(data_dir, flat, samples, shard_bytes), shardkit_factory(None)),
               "shardkit tar": (tar_url, shardkit_factory(None))}
    readers |= peers.build_peers(data_dir, flat, samples, SEQ + 1, shard_bytes, which=peers.PEERS,
                                 litdata_compressions=("zstd",))
    batch, runs = args.batch, args.runs
    cells: dict[str, dict[str, dict]] = {label: {} for label in readers}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for label, (url, factory) in readers.items():
            for workers in WORKERS:
                make = factory(url, batch, None, workers)
                cells[label][f"local, workers={workers}"] = measure(f"{label}, local, workers={workers}", make,
                                                                   samples, batch, runs, resume=_resumes(label))
        if not args.skip_s3:
            with MotoServer() as server, peers.environment({"AWS_ACCESS_KEY_ID": server.options.get("key"),
                                                            "AWS_SECRET_ACCESS_KEY": server.options.get("secret")}):
                for label, (url, factory) in readers.items():
                    remote = server.upload(url, Path(url).name)
                    for workers in WORKERS:
                        make = factory(remote, batch, server, workers)
                        cells[label][f"moto S3, workers={workers}"] = measure(
                            f"{label}, moto S3, workers={workers}", make, samples, batch, runs, resume=False)
    return {"machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg()},
            "data": {"samples": samples, "tokens_per_sample": SEQ + 1, "token_dtype": "uint16", "batch": batch,
                     "shard_mb": args.shard_mb, "runs": runs},
            "cells": cells}


def _resumes(label: str) -> bool:
    return not label.startswith("WebDataset")  # it has no loader state to save


# -- the table ------------------------------------------------------------------------------------
COLUMNS = [  # (heading, cell, value, higher is better)
    ("samples/s, local, 0 workers", "local, workers=0", "samples_per_s", True),
    ("samples/s, local, 2 workers", "local, workers=2", "samples_per_s", True),
    ("samples/s, moto S3, 0 workers", "moto S3, workers=0", "samples_per_s", True),
    ("samples/s, moto S3, 2 workers", "moto S3, workers=2", "samples_per_s", True),
    ("first batch fresh (s), local, 0 workers", "local, workers=0", "first_batch_s", False),
    ("first batch fresh (s), local, 2 workers", "local, workers=2", "first_batch_s", False),
    ("first batch fresh (s), moto S3, 0 workers", "moto S3, workers=0", "first_batch_s", False),
    ("first batch after resume (s), local, 0 workers", "local, workers=0", "resume_first_batch_s", False),
    ("first batch after resume (s), local, 2 workers", "local, workers=2", "resume_first_batch_s", False),
]
SHARDKIT = ("shardkit Arrow", "shardkit tar")


def table(result: dict) -> str:
    """A Markdown table: a row per measure, a column per reader, then shardkit's ratio to the best peer
    (above 1: shardkit ahead; for times, the best peer's time over shardkit's)."""
    cells = result["cells"]
    readers = list(cells)
    peer_labels = [r for r in readers if r not in SHARDKIT]
    head = ["", *readers, *(f"{s} vs best peer" for s in SHARDKIT)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for heading, cell, value, higher in COLUMNS:
        got = {r: cells[r].get(cell, {}).get(value) for r in readers}
        row = ["fails" if value.startswith("resume") and "resume_error" in cells[r].get(cell, {}) else
               _format(got[r], value) for r in readers]
        best = [got[p] for p in peer_labels if got[p] is not None]
        best = (max(best) if higher else min(best)) if best else None
        for s in SHARDKIT:
            if got[s] is None or best is None:
                row.append("")
            else:
                ratio = got[s] / best if higher else best / got[s]
                row.append(f"**{ratio:.2f}x**" if ratio < 1 else f"{ratio:.2f}x")
        lines.append(f"| {heading} | " + " | ".join(row) + " |")
    exact = ["yes" if all(c["exact"] for c in cells[r].values()) else "**no**" for r in readers]
    lines.append("| each sample once, every pass | " + " | ".join(exact) + " | | |")
    resumed = [" / ".join(_resumed(cells[r].get(f"local, workers={w}", {})) for w in WORKERS) for r in readers]
    lines.append("| resumed pass exact (0 / 2 workers) | " + " | ".join(resumed) + " | | |")
    return "\n".join(lines)


def _format(value, kind: str) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.0f}" if kind == "samples_per_s" else f"{value:.3f}"


def _resumed(cell: dict) -> str:
    if "resume_error" in cell:
        return "fails"
    value = cell.get("resumed_exactly")
    return "n/a" if value is None else "yes" if value else "**no**"
