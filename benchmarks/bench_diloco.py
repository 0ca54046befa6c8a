"""DiLoCo vs DDP at an equal token budget: held-out loss and bytes communicated per token.

    python benchmarks/bench_diloco.py [--nproc 4] [--steps 500] [--seeds 0 1 2] [--variants ddp h10 h50 f4 delay]

Builds ../shared/corpora/prose.jsonl.zst with the GPT-2 tokenizer (as benchmarks/e2e_prose.py does,
sharing its work directory), then for every variant and seed launches `torchrun --nproc_per_node N
-m shardkit.train --preset tiny` on CPU (gloo) for the same steps and batch, so every variant trains
on the same tokens. Bytes come from the run's metrics.jsonl (counted from the collectives issued:
DDP's gradient buckets, DiLoCo's pseudo-gradient all-reduces); the held-out loss is the final eval.
The table shows medians over the seeds (`--seed`: weight init; the data order is the same) and
writes JSON with the exact commands.

Variants: ddp; diloco h10 / h50 (H = 10, 50); f4 (H = 50, 4 fragments); delay (H = 50, --sync-delay 1).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_prose import prepare_data  # noqa: E402

SHARED = Path(os.environ.get("SHARDKIT_SHARED", Path(__file__).resolve().parents[2] / "shared"))

VARIANTS: dict[str, list[str]] = {
    "ddp": ["--parallel", "ddp"],
    "h10": ["--parallel", "diloco", "--sync-every", "10"],
    "h50": ["--parallel", "diloco", "--sync-every", "50"],
    "f4": ["--parallel", "diloco", "--sync-every", "50", "--sync-fragments", "4"],
    "delay": ["--parallel", "diloco", "--sync-every", "50", "--sync-delay", "1"],
}


def run_variant(args: argparse.Namespace, name: str, seed: int, train: Path, held_out: Path) -> dict:
    run_dir = Path(args.work_dir) / "diloco-runs" / f"{name}-seed{seed}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
               "-m", "shardkit.train", "--data", str(train), "--eval-data", str(held_out), "--preset", "tiny",
               "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--lr", str(args.lr),
               "--warmup-steps", str(max(1, args.steps // 10)), "--eval-batches", str(args.eval_batches),
               "--seed", str(seed), "--device", "cpu", "--log-every", str(max(1, args.steps // 5)),
               "--run-dir", str(run_dir), "--resume", "none", "--checkpoint-every", "0", "--save-final", "false",
               "--tensorboard", "false", "--cache-dir", str(Path(args.work_dir) / "cache"), *VARIANTS[name]]
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                   stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    return {"variant": name, "seed": seed, "command": command, "held_out_loss": evals[-1]["eval_loss"],
            "bytes_per_token": steps[-1]["comm_bytes_per_token"], "total_bytes_per_rank": sum(r["comm_bytes"] for r in steps),
            "comm_blocked_s": sum(r["comm_blocked_s"] for r in steps),
            "step_time_s": statistics.median(r["step_time_s"] for r in steps)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--work-dir", default="/tmp/shardkit-e2e")
    parser.add_argument("--out", default="bench_out/diloco.json")
    args = parser.parse_args()
    train, held_out = prepare_data(Path(args.work_dir), args.seq_len, SHARED)
    runs = [run_variant(args, name, seed, train, held_out) for name in args.variants for seed in args.seeds]
    table = {}
    for name in args.variants:
        mine = [r for r in runs if r["variant"] == name]
        table[name] = {key: statistics.median(r[key] for r in mine)
                       for key in ("held_out_loss", "bytes_per_token", "comm_blocked_s", "step_time_s")}
    base = table.get("ddp")
    print(f"{'variant':<8} {'held-out loss':>13} {'vs ddp':>7} {'bytes/token':>12} {'ddp/this':>9} {'blocked s':>10}")
    for name, row in table.items():
        ratio = base["bytes_per_token"] / row["bytes_per_token"] if base and row["bytes_per_token"] else None
        gap = row["held_out_loss"] / base["held_out_loss"] - 1 if base else None
        row.update(bytes_reduction_vs_ddp=ratio, loss_gap_vs_ddp=gap)
        print(f"{name:<8} {row['held_out_loss']:>13.4f} {'' if gap is None else f'{100 * gap:+.1f}%':>7} "
              f"{row['bytes_per_token']:>12.1f} {'' if ratio is None else f'{ratio:.1f}x':>9} "
              f"{row['comm_blocked_s']:>10.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "table": table, "runs": runs,
                                          "machine": platform.platform()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
