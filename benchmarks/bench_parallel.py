"""Parallel layouts compared: tokens/s, step time, peak memory and bytes per collective kind per step.

    python benchmarks/bench_parallel.py [--preset tiny] [--layouts single,tp2,pp2,dp_shard2] [--runs 3]
                                        [--steps 6] [--device cpu] [--out bench_out/parallel.json]

For each layout, `torchrun -m shardkit.train` runs --runs times over the same random-token dataset
(bench_train's, vocabulary padded to 50304 so that it divides any --tp); each run's metrics.jsonl
gives per-step figures, the first step (warm-up, shape inference) left out; per run the median over
the remaining steps, and the table shows the median over runs. The bytes per collective kind are
those the trainer counts itself (`metrics.CollectiveCounter`), per rank (rank 0). The global batch
is the same in every layout (--global-batch samples per step). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import build_data  # noqa: E402  (one random-token dataset writer for both benchmarks)

# name: (processes, data-parallel ranks, options)
LAYOUTS = {
    "single": (1, 1, ()),
    "ddp2": (2, 2, ("--parallel", "ddp")),
    "dp_shard2": (2, 2, ("--dp-shard", "2")),
    "tp2": (2, 1, ("--tp", "2")),
    "pp2": (2, 1, ("--pp", "2", "--pp-schedule", "1f1b")),
    "pp2_interleaved": (2, 1, ("--pp", "2", "--pp-schedule", "interleaved1f1b")),
    "tp2_dp_shard2": (4, 2, ("--tp", "2", "--dp-shard", "2")),
    "pp2_dp_shard2": (4, 2, ("--pp", "2", "--dp-shard", "2")),
    "pp2_tp2": (4, 1, ("--pp", "2", "--tp", "2")),
    "dp_replicate2_dp_shard2": (4, 4, ("--dp-replicate", "2", "--dp-shard", "2")),
}
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


def run_layout(args: argparse.Namespace, data: str, layout: str, run_dir: Path) -> dict[str, float]:
    nproc, dp, options = LAYOUTS[layout]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               "-m", "shardkit.train", "--data", data, "--preset", args.preset, "--steps", str(args.steps),
               "--warmup-steps", "1", "--batch-size", str(args.global_batch // dp), "--device", args.device,
               "--vocab-size", "50304", "--tie-embeddings", "false", "--n-layer", str(args.n_layer),
               "--log-every", "1000", "--run-dir", str(run_dir), "--checkpoint-every", "0", "--save-final", "false",
               "--resume", "none", "--cache-dir", str(run_dir.parent / "cache"), *options]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{layout} failed:\n{result.stderr[-4000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r][1:]
    figures = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps),
               "step_time_s": statistics.median(r["step_time_s"] for r in steps),
               "peak_memory_gib": max(r["peak_memory_gib"] for r in steps)}
    for kind in KINDS:
        figures[f"{kind}_bytes"] = statistics.median(r.get(f"comm_bytes_{kind}", 0) for r in steps)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--n-layer", type=int, default=4, help="layers (4 allows 2 x 2 interleaved stages)")
    parser.add_argument("--layouts", default="single,ddp2,dp_shard2,tp2,pp2,pp2_interleaved")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--data-dir", default=str(Path(tempfile.gettempdir()) / "shardkit-bench-data"))
    parser.add_argument("--out", default="bench_out/parallel.json")
    args = parser.parse_args()
    layouts = args.layouts.split(",")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layouts {unknown}; choose from {list(LAYOUTS)}")
    data = build_data(Path(args.data_dir), samples=max(64, args.global_batch * args.steps * 2), seq_len=args.seq_len)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for layout in layouts:
            runs = [run_layout(args, data, layout, Path(tmp) / f"{layout}-{i}" / "run") for i in range(args.runs)]
            results[layout] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    header = f"{'layout':<24} {'tok/s':>9} {'step s':>8} {'mem GiB':>8} " + " ".join(f"{k:>15}" for k in KINDS)
    print(header)
    for layout, r in results.items():
        print(f"{layout:<24} {r['tokens_per_s']:>9.0f} {r['step_time_s']:>8.3f} {r['peak_memory_gib']:>8.2f} "
              + " ".join(f"{r[f'{k}_bytes'] / 1e6:>13.2f}MB" for k in KINDS))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": sys.argv, "preset": args.preset, "n_layer": args.n_layer,
                               "global_batch": args.global_batch, "seq_len": args.seq_len, "runs": args.runs,
                               "machine": platform.platform(), "cpus": os.cpu_count(), "results": results},
                              indent=1) + "\n")


if __name__ == "__main__":
    main()
