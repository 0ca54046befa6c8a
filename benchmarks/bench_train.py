"""Trainer throughput: tokens/s, MFU, data-wait fraction and peak memory of `shardkit.train`.

    python benchmarks/bench_train.py [--preset gpt2-124m] [--nproc 1] [--runs 3] [--data URL] [--out bench_out/train.json]

Writes a dataset of random token ids (GPT-2 vocabulary, --seq-len + 1 tokens per sample) once under
--data-dir, then launches `torchrun --standalone --nproc_per_node N -m shardkit.train` --runs times
with the given options and reads each run's metrics.jsonl. The first --skip steps (CUDA warm-up,
torch.compile) are left out; per run the median over the remaining steps is taken, and the table
shows the median over runs. Random tokens make the loss meaningless but cost the model exactly what
real text costs. Prints a table and writes JSON with the exact command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

VOCAB = 50257


def build_data(data_dir: Path, *, samples: int, seq_len: int) -> str:
    from shardkit.formats import ShardWriter
    from shardkit.manifest import Manifest, TokenizerInfo, write_manifest

    url = data_dir / f"random-{seq_len}-{samples}"
    if (url / "shardkit.json").exists():
        return str(url)
    rng = np.random.default_rng(0)
    with ShardWriter(str(url), token_dtype="uint16", max_samples=4096) as writer:
        for start in range(0, samples, 1024):
            for row in rng.integers(0, VOCAB, size=(min(1024, samples - start), seq_len + 1), dtype=np.uint16):
                writer.write(row)
    manifest = Manifest(shard_format="tar", token_dtype="uint16", seq_len=seq_len, packing="custom",
                        tokenizer=TokenizerInfo(kind="random", name="random", vocab_size=VOCAB),
                        shards=tuple(writer.shards), build={"generator": "benchmarks/bench_train.py"})
    write_manifest(writer.storage, manifest)
    return str(url)


def train_command(args: argparse.Namespace, data: str, run_dir: Path) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
               "-m", "shardkit.train", "--data", data, "--preset", args.preset, "--steps", str(args.steps),
               "--warmup-steps", "5", "--batch-size", str(args.batch_size), "--precision", args.precision,
               "--compile", str(args.compile).lower(), "--log-every", "10", "--run-dir", str(run_dir),
               "--checkpoint-every", "0", "--save-final", "false", "--resume", "none",
               "--num-workers", str(args.num_workers), "--cache-dir", str(run_dir.parent / "cache")]
    if args.parallel:
        command += ["--parallel", args.parallel]
    if args.vocab_size:
        command += ["--vocab-size", str(args.vocab_size)]
    return command + args.extra


def summarise(run_dir: Path, skip: int) -> dict[str, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if "loss" in r and r["step"] > skip]
    if not steady:
        raise SystemExit(f"{run_dir}: no steps after the first {skip}: raise --steps")

    def median(key):
        values = [r[key] for r in steady if r[key] is not None]
        return statistics.median(values) if values else None

    return {"tokens_per_s": median("tokens_per_s"), "tokens_per_s_per_device": median("tokens_per_s_per_device"),
            "mfu": median("mfu"), "data_wait_fraction": median("data_wait_fraction"),
            "step_time_s": median("step_time_s"), "peak_memory_gib": max(r["peak_memory_gib"] for r in steady),
            # the last logged step's training loss (meaningful with --data: real text, not random tokens)
            "final_loss": steady[-1]["loss"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpt2-124m")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--parallel", default=None, help="ddp, fsdp, hsdp (default: the trainer's auto)")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--vocab-size", type=int, default=50304, help="model vocabulary (GPT-2's padded to 64)")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=15, help="leading steps left out (warm-up, compilation)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--data", default=None,
                        help="train on this shardkit dataset (e.g. real GPT-2-tokenized text, whose final loss means "
                             "something) instead of random tokens")
    parser.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "shardkit-bench-train"))
    parser.add_argument("--out", default="bench_out/train.json")
    parser.add_argument("extra", nargs="*", help="more trainer options after --, e.g. -- --activation-checkpointing")
    args = parser.parse_args()

    samples = args.steps * args.batch_size * args.nproc + 1024
    data = args.data or build_data(Path(args.data_dir), samples=samples, seq_len=args.seq_len)
    results = []
    for index in range(args.runs):
        run_dir = Path(args.data_dir) / "runs" / f"run-{index}"
        command = train_command(args, data, run_dir)
        print("$", shlex.join(command), flush=True)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "8")}
        subprocess.run(command, check=True, env=env)
        results.append(summarise(run_dir, args.skip))

    def median(key):
        values = [r[key] for r in results if r[key] is not None]
        return statistics.median(values) if values else None

    summary = {key: median(key) for key in results[0]}
    device = "cpu"
    try:
        import torch
        if torch.cuda.is_available():
            device = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    print(f"\n{'metric':<26}{'median of ' + str(args.runs) + ' runs':>22}")
    for key, value in summary.items():
        shown = "n/a" if value is None else (f"{100 * value:.1f}%" if key in ("mfu", "data_wait_fraction")
                                             else f"{value:,.2f}")
        print(f"{key:<26}{shown:>22}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "device": device, "host": platform.node(), "preset": args.preset, "seq_len": args.seq_len,
        "batch_size": args.batch_size, "nproc": args.nproc, "precision": args.precision, "compile": args.compile,
        "data": args.data or "random tokens",
        "command": shlex.join(train_command(args, data, Path("RUN_DIR"))), "runs": results, "median": summary,
    }, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
