"""The data service (issue 43, item 7): `shardkit serve` against the in-process loader, in one run.

Raw text (a slice of ../shared/corpora/mix.jsonl.zst, --mb of decompressed JSONL) tokenized with the GPT-2 HF
tokenizer (../shared/tokenizers/gpt2_hf_tokenizer.json), seq_len --seq-len, batch --batch; every figure the median
of --runs runs:

1. Data wait of a simulated trainer (one rank: --step-ms of sleep per step stands for the GPU's work, --steps
   steps): the share of the wall time spent in the loader's next(), in-process (`StreamingDataLoader`, no
   workers: the tokenization runs on the trainer's CPU) against the service with 1, 2 and 4 worker processes
   (with 2 and 4, each worker reads a part of every step: its lanes).
2. Throughput with no step time, same configurations: tokens/s (the service with one worker against the
   in-process loader: its per-worker rate).
3. Added latency per batch: built data (byte-level, small batches: the transport's cost dominates), median time
   per batch through the service (1 worker, read ahead) minus in-process.
4. Stall after a worker kill: 2 workers, the consumer reading without step time; the worker serving it is
   SIGKILLed after --kill-after batches; the stall is the longest gap between two batches after the kill minus
   the median gap before it.
5. `--dispatch` (alone): the dispatcher at a scale one machine cannot hold as real workers, 8 x 2, 64 x 16 and
   256 x 64 simulated consumers x workers on loopback (`service_dispatch.py`).

On a machine with few cores the workers compete with the consumer for them: the data wait then measures the
machine, not the design (the service moves tokenization to other machines' CPUs). Prints a table, writes JSON.
    SHARDKIT_SHARED=/work/shared python benchmarks/bench_service.py --runs 3 --out service.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
SHARED = Path(os.environ.get("SHARDKIT_SHARED", REPO.parent / "shared"))


def write_slice(out: Path, megabytes: float) -> Path:
    import zstandard

    out.mkdir(parents=True, exist_ok=True)
    budget = int(megabytes * 1e6)
    with open(SHARED / "corpora" / "mix.jsonl.zst", "rb") as raw:
        text = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw), encoding="utf-8")
        lines, size = [], 0
        for line in text:
            lines.append(line)
            size += len(line)
            if size >= budget:
                break
    (out / "part.jsonl").write_text("".join(lines))
    return out


def consume(loader, steps: int, step_seconds: float) -> dict:
    """Wall time, time in next(), tokens and per-batch gaps of `steps` batches with `step_seconds` of work each."""
    it = iter(loader)
    waited, tokens, gaps = 0.0, 0, []
    start = time.perf_counter()
    for _ in range(steps):
        asked = time.perf_counter()
        batch = next(it)
        got = time.perf_counter()
        waited += got - asked
        gaps.append(got - asked)
        tokens += batch["tokens"].numel()
        if step_seconds:
            time.sleep(step_seconds)
    return {"wall": time.perf_counter() - start, "waited": waited, "tokens": tokens, "gaps": gaps}


def in_process(spec, batch: int):
    from shardkit.loaders import StreamingDataLoader, StreamingDataset

    return StreamingDataLoader(StreamingDataset(spec.dataset_source(), **spec.options), batch_size=batch)


def served(url: str, batch: int):
    from shardkit.loaders import StreamingDataLoader, StreamingDataset

    return StreamingDataLoader(StreamingDataset(None, service=url, service_timeout=120), batch_size=batch)


def service(spec, workers: int):
    from shardkit.serve.local import LocalService

    running = LocalService(spec, workers=workers)
    running.wait_for_workers(workers, timeout=300)
    return running


def per_workers(spec, args, runs: int) -> dict:
    """Data wait (with --step-ms per step) and throughput (without) of the in-process loader and of the service
    with 1, 2 and 4 workers (2 and 4 read each step in parts), each service started once for its runs."""
    rows = {}
    for name, workers in [("in-process", 0), ("service, 1 worker", 1), ("service, 2 workers", 2),
                          ("service, 4 workers", 4)]:
        shares, rates = [], []
        running = service(spec, workers) if workers else None
        try:
            for _ in range(runs):
                for step_seconds in (args.step_ms / 1000, 0):
                    loader = in_process(spec, args.batch) if running is None else served(running.url, args.batch)
                    result = consume(loader, args.steps, step_seconds)
                    if step_seconds:
                        shares.append(result["waited"] / result["wall"])
                    else:
                        rates.append(result["tokens"] / result["wall"])
        finally:
            if running is not None:
                running.close()
        rows[name] = {"data_wait_share": statistics.median(shares), "tokens_per_s": statistics.median(rates),
                      "wait_runs": shares, "rate_runs": rates}
    rows["per_worker_vs_in_process"] = (rows["service, 1 worker"]["tokens_per_s"]
                                        / rows["in-process"]["tokens_per_s"])
    return rows


def latency(args, runs: int, root: Path) -> dict:
    from loader_helpers import write_fixed
    from shardkit.serve.data import DataSpec

    write_fixed(str(root / "built"), 4096, seq_len=128, per_shard=512)
    spec = DataSpec(source=str(root / "built"), options={"cache_dir": str(root / "cache")})
    per_batch = {"in-process": [], "service": []}
    with service(spec, 1) as running:
        for _ in range(runs):
            for name in per_batch:
                loader = in_process(spec, 8) if name == "in-process" else served(running.url, 8)
                result = consume(loader, 400, 0)
                per_batch[name].append(statistics.median(result["gaps"][20:]))
    med = {name: statistics.median(v) for name, v in per_batch.items()}
    return {"in_process_ms": med["in-process"] * 1e3, "service_ms": med["service"] * 1e3,
            "added_ms": (med["service"] - med["in-process"]) * 1e3}


def stall(spec, args, runs: int) -> dict:
    stalls = []
    for _ in range(runs):
        with service(spec, 2) as running:
            loader = served(running.url, args.batch)
            it = iter(loader)
            gaps = []
            for _ in range(args.kill_after):
                asked = time.perf_counter()
                next(it)
                gaps.append(time.perf_counter() - asked)
            busy = [w for w in running.workers() if w["load"].get("streams")] or running.workers()
            os.kill(busy[0]["pid"], signal.SIGKILL)
            after = []
            for _ in range(args.kill_after):
                asked = time.perf_counter()
                next(it)
                after.append(time.perf_counter() - asked)
            stalls.append(max(after) - statistics.median(gaps))
    return {"stall_s": statistics.median(stalls), "runs": stalls}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=2.0, help="decompressed JSONL of the corpus slice")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-ms", type=float, default=50.0, help="simulated GPU time per step")
    parser.add_argument("--kill-after", type=int, default=20)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="bench_service.json")
    parser.add_argument("--dispatch", action="store_true",
                        help="only the dispatcher at scale: simulated consumers x workers on loopback "
                             "(service_dispatch.py)")
    parser.add_argument("--dispatch-seconds", type=float, default=4.0)
    args = parser.parse_args(argv)
    if args.dispatch:
        from service_dispatch import dispatcher_scale

        rows = dispatcher_scale([(8, 2), (64, 16), (256, 64)], seconds=args.dispatch_seconds, runs=args.runs)
        Path(args.out).write_text(json.dumps({"machine": {"cpus": os.cpu_count()}, "args": vars(args),
                                              "dispatch": rows}, indent=1))
        return 0
    from shardkit.serve.data import DataSpec

    root = Path(tempfile.mkdtemp(prefix="bench_service_"))
    corpus = write_slice(root / "corpus", args.mb)
    tokenizer = str(SHARED / "tokenizers" / "gpt2_hf_tokenizer.json")
    spec = DataSpec(source=str(corpus), options=dict(tokenizer=tokenizer, seq_len=args.seq_len, lanes=8,
                                                     unit_bytes=1 << 16))
    results = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()}, "args": vars(args),
               "workers": per_workers(spec, args, args.runs), "latency": latency(args, args.runs, root),
               "stall": stall(spec, args, args.runs)}
    print(f"{'what':<40} {'median':>12}")
    rows = {name: row for name, row in results["workers"].items() if isinstance(row, dict)}
    for name, row in rows.items():
        print(f"{'data wait share, ' + name:<40} {row['data_wait_share']:>11.1%}")
    for name, row in rows.items():
        print(f"{'tokens/s, ' + name:<40} {row['tokens_per_s']:>12,.0f}")
    print(f"{'service per worker / in-process':<40} {results['workers']['per_worker_vs_in_process']:>11.0%}")
    print(f"{'ms per batch, built, in-process':<40} {results['latency']['in_process_ms']:>12.3f}")
    print(f"{'ms per batch, built, service':<40} {results['latency']['service_ms']:>12.3f}")
    print(f"{'added latency per batch (ms)':<40} {results['latency']['added_ms']:>12.3f}")
    print(f"{'stall after a worker kill (s)':<40} {results['stall']['stall_s']:>12.3f}")
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
