"""What a warm batch costs in CPU, and the first batch after a resume against a fresh epoch's (issue 36 items 2, 3).

    python benchmarks/batch_cost.py [--baseline PYTHON] [--runs 3] [--data-dir DIR]

Data: 20,000 samples of 1,025 random uint16 tokens with two documents each, Arrow shards of 2,000 samples,
built once under --data-dir; a warm cache (one full pass) before anything is timed. Each figure comes from a
child process (`--measure`), so `--baseline` (the python of another install, e.g. main's) and this tree
alternate run by run in one command; medians over `--runs` children.

Measured as CPU time, which the machine's load disturbs far less than wall time:
- warm: CPU microseconds per batch of 8 over one epoch (median of 3 epochs), the main process plus its
  DataLoader workers (persistent workers, their CPU read from /proc), with 0 and 2 workers;
- first batch: a new loader on the warm cache, `iter()` to its first batch, at an epoch's start ("fresh")
  and after `load_state_dict` at 50% of the epoch ("resumed"), wall and main-process CPU, medians of 3.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SAMPLES, SEQ, PER_SHARD, BATCH = 20_000, 1024, 2_000, 8


def at_position(state: dict, samples: int) -> dict:
    """A loader state moved to position `samples` of its epoch (state version 2, or the flat version 1 of a
    baseline release measured beside it)."""
    if "position" in state:
        return {**state, "position": {**state["position"], "samples": samples}}
    return {**state, "samples_consumed": samples}


def build(url: str) -> None:
    from shardkit.formats import Sample, write_dataset
    from shardkit.manifest import TokenizerInfo

    rng = np.random.default_rng(0)

    def samples():
        for _ in range(SAMPLES):
            tokens = rng.integers(0, 50_000, SEQ + 1, dtype=np.int64)
            yield Sample(tokens, np.array([0, int(rng.integers(1, SEQ))]), np.zeros(2, dtype=np.int64), np.arange(2))

    write_dataset(url, samples(), tokenizer=TokenizerInfo(kind="byte", name="bench", vocab_size=50_000),
                  seq_len=SEQ, packing="concat", shard_format="arrow", max_samples=PER_SHARD)


def _worker_cpu(loader) -> float:
    """CPU seconds of the loader's live DataLoader workers (utime + stime from /proc)."""
    iterator = getattr(loader, "_iterator", None)
    total = 0.0
    for worker in getattr(iterator, "_workers", []) or []:
        with open(f"/proc/{worker.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def measure(url: str, cache: str) -> dict:
    from shardkit import StreamingDataLoader, StreamingDataset

    def loader(workers: int) -> StreamingDataLoader:
        return StreamingDataLoader(StreamingDataset(url, cache_dir=cache, rank=0, world_size=1), batch_size=BATCH,
                                   num_workers=workers, persistent_workers=workers > 0)

    for _ in loader(0):  # warm cache
        pass
    out: dict = {}
    for workers in (0, 2):
        warm = loader(workers)
        for _ in warm:  # starts the persistent workers
            pass
        costs = []
        for _ in range(3):
            cpu, before = time.process_time(), _worker_cpu(warm)
            count = sum(1 for _ in warm)
            costs.append((time.process_time() - cpu + _worker_cpu(warm) - before) / count * 1e6)
        out[f"warm_cpu_us_per_batch_w{workers}"] = statistics.median(costs)
        del warm
        state = at_position(loader(0).state_dict(), len(loader(0)) // 2 * BATCH)
        for name, resumed in (("fresh", False), ("resumed", True)):
            walls, cpus = [], []
            for _ in range(3):
                wall, cpu = time.perf_counter(), time.process_time()
                first = loader(workers)
                if resumed:
                    first.load_state_dict(state)
                iterator = iter(first)
                next(iterator)
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
                del iterator, first
            out[f"first_{name}_wall_s_w{workers}"] = statistics.median(walls)
            out[f"first_{name}_cpu_s_w{workers}"] = statistics.median(cpus)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", help="python of another install to measure alternately (e.g. main's)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--data-dir", default="/tmp/shardkit-batch-cost")
    parser.add_argument("--measure", nargs=2, metavar=("URL", "CACHE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return
    data = Path(args.data_dir)
    url = str(data / "data")
    if not (data / "data" / "shardkit.json").exists():
        build(url)
    pythons = {"this tree": sys.executable, **({"baseline": args.baseline} if args.baseline else {})}
    rows: dict[str, list[dict]] = {name: [] for name in pythons}
    for run in range(args.runs):
        for name, python in pythons.items():  # alternating: both see the same moments of the load
            cache = data / f"cache-{name.replace(' ', '-')}-{run}"
            done = subprocess.run([python, __file__, "--measure", url, str(cache)], check=True, text=True,
                                  capture_output=True, cwd=data)
            rows[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{'median of ' + str(args.runs):<34}" + "".join(f"{name:>14}" for name in rows))
    for key in rows["this tree"][0]:
        print(f"{key:<34}" + "".join(f"{statistics.median(r[key] for r in runs):>14.4g}" for runs in rows.values()))


if __name__ == "__main__":
    main()
