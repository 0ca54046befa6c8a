"""Trainer throughput against a bare loop (issue 31), in one run that fits one 10-minute device call.

    python benchmarks/bench_train.py --text ../shared/corpora/prose.jsonl.zst \
        --tokenizer ../shared/tokenizers/gpt2_hf_tokenizer.json --runs 3 --budget 540 --out bench_out/train-issue31.json
    python benchmarks/bench_train.py --smoke      # CPU, tiny model, seconds: the whole script end to end

The cases (a table in CASES; `--cases` picks some):
  a          gpt2-124m, bf16, compiled, today's step: 16 x 1024 tokens, 200 steps (the step-200 loss on real text)
  b          gpt2-124m, micro-batch 32, --global-batch-tokens 524288 (0.5M tokens per step, 16 micro-steps)
  a-bare, b-bare  the same model, optimizer, batch and compile in a bare loop on random tokens already on the
             GPU (no loader, metrics or checkpoints): trainer/bare is the loop's own cost
  llama-1b   --parallel fsdp --activation-checkpointing --compile, micro-batch 8 x 1024
  plain-2048, docmask-2048   gpt2-124m at seq_len 2048, plain causal against --document-mask attention

Trainer cases launch `torchrun -m shardkit.train` (in this process with --smoke); the bare loop runs here.
Runs go round by round (every case once, then again), so that when the time budget (--budget seconds)
runs short, every case has its first run and the later rounds are what is left out (the JSON says so). A
trainer run's figures are over its steps after --skip (a multiple of the sync interval): tokens/s is
their tokens over their summed time (on a GPU single step times are the host's, only sums are exact), MFU
and data wait are time-weighted; the table shows the median over runs. Real text (--text + --tokenizer:
built here with `shardkit build` at seq_len 1024 and 2048, or --data/--data-2048) makes the loss mean
something; without, random tokens with document boundaries (same cost, meaningless loss).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VOCAB = 50257


@dataclass(frozen=True)
class Case:
    name: str
    preset: str
    batch_size: int
    seq_len: int
    steps: int
    skip: int  # leading steps left out (compilation, warm-up): a multiple of log_every
    log_every: int
    options: tuple[str, ...] = ()
    bare: bool = False  # the bare reference loop instead of the trainer
    grad_accum: int = 1  # the bare loop's (the trainer derives it from --global-batch-tokens)


CASES = (
    Case("a", "gpt2-124m", 16, 1024, steps=200, skip=40, log_every=10),
    Case("b", "gpt2-124m", 32, 1024, steps=16, skip=8, log_every=4, options=("--global-batch-tokens", "524288")),
    Case("a-bare", "gpt2-124m", 16, 1024, steps=40, skip=20, log_every=10, bare=True),
    Case("b-bare", "gpt2-124m", 32, 1024, steps=6, skip=2, log_every=2, bare=True, grad_accum=16),
    Case("llama-1b", "llama-1b", 8, 1024, steps=20, skip=10, log_every=5,
         options=("--parallel", "fsdp", "--activation-checkpointing", "true")),
    Case("plain-2048", "gpt2-124m", 8, 2048, steps=40, skip=20, log_every=10),
    Case("docmask-2048", "gpt2-124m", 8, 2048, steps=40, skip=20, log_every=10, options=("--document-mask", "true")),
)


def smoke_case(case: Case) -> Case:
    """The same case on a CPU in seconds: the tiny preset, 32- or 64-token windows, a few steps."""
    seq_len = 64 if case.seq_len == 2048 else 32
    options = tuple("256" if value == "524288" else value for value in case.options)  # 4 x 32 x 2 micro-steps
    return dataclasses.replace(case, preset="tiny", batch_size=4, seq_len=seq_len, steps=4, skip=2, log_every=2,
                               options=options, grad_accum=2 if case.grad_accum > 1 else 1)


# -- data ------------------------------------------------------------------------------------------
def random_documents(url: Path, *, seq_len: int, samples: int, vocab: int) -> str:
    """Random token ids in documents of seq_len/16 to seq_len/2 tokens (boundaries for --document-mask)."""
    from shardkit.formats import Sample, write_dataset
    from shardkit.manifest import TokenizerInfo

    if (url / "shardkit.json").exists():
        return str(url)
    rng = np.random.default_rng(0)

    def generate():
        for index in range(samples):
            tokens = rng.integers(0, vocab, size=seq_len + 1, dtype=np.uint16)
            lengths = rng.integers(max(4, seq_len // 16), seq_len // 2, size=seq_len)
            starts = np.concatenate([[0], np.cumsum(lengths)])
            starts = starts[starts < seq_len + 1]
            yield Sample(tokens, starts, np.zeros(len(starts), dtype=np.int64), np.arange(len(starts)) + index * 4096)

    write_dataset(str(url), generate(), tokenizer=TokenizerInfo(kind="random", name="random", vocab_size=vocab),
                  seq_len=seq_len, packing="concat", sources=("random",), max_samples=4096)
    return str(url)


def real_text(url: Path, *, text: str, tokenizer: str, seq_len: int) -> str:
    """`shardkit build` of the corpus at `seq_len` (once; 5.4 s for prose.jsonl.zst at 1024 on the H200)."""
    from shardkit.cli import main as shardkit_main

    if not (url / "shardkit.json").exists() and shardkit_main([
            "build", text, "--output", str(url), "--tokenizer", tokenizer, "--seq-len", str(seq_len),
            "--workers", str(min(8, os.cpu_count() or 1)), "--no-progress"]) != 0:
        raise SystemExit(f"shardkit build of {text} at seq_len {seq_len} failed")
    return str(url)


def datasets(args: argparse.Namespace) -> dict[int, str]:
    """seq_len -> dataset URL for the cases' two context lengths."""
    root = Path(args.data_dir)
    if args.smoke:
        return {n: random_documents(root / f"smoke-{n}", seq_len=n, samples=256, vocab=256) for n in (32, 64)}
    if args.text:
        return {n: real_text(root / f"text-{n}", text=args.text, tokenizer=args.tokenizer, seq_len=n) for n in
                (1024, 2048)}
    given = {1024: args.data, 2048: args.data_2048}
    return {n: given[n] or random_documents(root / f"random-{n}", seq_len=n, samples=6000 if n == 1024 else 3000,
                                            vocab=VOCAB) for n in (1024, 2048)}


# -- the trainer -----------------------------------------------------------------------------------
def trainer_options(case: Case, args: argparse.Namespace, data: str, run_dir: Path) -> list[str]:
    return ["--data", data, "--preset", case.preset, "--steps", str(case.steps),
            "--warmup-steps", str(min(5, case.steps - 1)), "--batch-size", str(case.batch_size),
            "--precision", args.precision, "--compile", str(args.compile).lower(), "--log-every", str(case.log_every),
            "--run-dir", str(run_dir), "--checkpoint-every", "0", "--save-final", "false", "--resume", "none",
            "--num-workers", str(args.num_workers), "--cache-dir", str(run_dir.parent / "cache"),
            "--tensorboard", "false", "--device", args.device, *case.options]


def launch_prefix(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "-m", "shardkit.train"]


def run_trainer(case: Case, args: argparse.Namespace, data: str, run_dir: Path) -> dict[str, float]:
    options = trainer_options(case, args, data, run_dir)
    print("$", shlex.join(launch_prefix(args.nproc) + options), flush=True)
    if args.smoke:  # in this process: the same options, without torchrun's start-up
        from shardkit.train.__main__ import main as train_main

        if train_main(options) != 0:
            raise SystemExit(f"case {case.name}: the trainer failed")
    else:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "8")}
        subprocess.run(launch_prefix(args.nproc) + options, check=True, env=env)
    return summarise(run_dir, case)


def summarise(run_dir: Path, case: Case) -> dict[str, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "loss" in r]
    steady = [r for r in trained if r["step"] > case.skip]
    if not steady:
        raise SystemExit(f"{run_dir}: no steps after the first {case.skip}")
    seconds = sum(r["step_time_s"] for r in steady)

    def weighted(key):  # over time: the run's overall MFU and data-wait fraction
        return None if steady[0][key] is None else sum(r[key] * r["step_time_s"] for r in steady) / seconds

    return {"tokens_per_s": sum(r["tokens_per_s"] * r["step_time_s"] for r in steady) / seconds,
            "mfu": weighted("mfu"), "data_wait_fraction": weighted("data_wait_fraction"),
            "step_time_s": seconds / len(steady), "peak_memory_gib": max(r["peak_memory_gib"] for r in steady),
            "final_step": trained[-1]["step"], "final_loss": trained[-1]["loss"]}


# -- the bare reference loop -----------------------------------------------------------------------
def run_bare(case: Case, args: argparse.Namespace) -> dict[str, float]:
    """The trainer's model, optimizer, loss, compile and batch, on random tokens already on the device."""
    import torch

    from shardkit.train.config import PRESETS, ModelConfig, OptimizerConfig, ParallelConfig
    from shardkit.train.metrics import peak_flops
    from shardkit.train.model import Transformer, flops_per_token
    from shardkit.train.optim import build_optimizer
    from shardkit.train.parallel import init_runtime, parallelize
    from shardkit.train.precision import PrecisionChoice

    runtime = init_runtime(ParallelConfig(parallel="none"), device=args.device)
    device = runtime.device
    vocab = 256 if args.smoke else VOCAB
    model_config = ModelConfig(**PRESETS[case.preset]["model"], vocab_size=vocab, seq_len=case.seq_len)
    torch.manual_seed(0)
    model = Transformer(model_config).to(device)
    parallel = parallelize(model, runtime, ParallelConfig(parallel="none"), param_dtype=None, compile=args.compile,
                           activation_checkpointing=False)
    optimizer = build_optimizer(parallel.model, OptimizerConfig(**PRESETS[case.preset].get("optimizer", {})),
                                fused=device.type == "cuda")
    precision = PrecisionChoice(args.precision, "asked for by bench_train.py --precision")
    dtype = precision.compute_dtype
    tokens = torch.randint(0, vocab, (case.grad_accum, case.batch_size, case.seq_len + 1), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def step():
        for micro in range(case.grad_accum):
            with runtime.autocast(dtype):
                parallel.forward_backward(tokens[micro, :, :-1], tokens[micro, :, 1:], None,
                                          scale=1.0 / case.grad_accum, sync=micro == case.grad_accum - 1)
        parallel.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(case.skip):
        step()
    sync()
    windows = []
    for _ in range(3):  # medians of 3 windows of log_every steps, the device drained at each end only
        started = time.perf_counter()
        for _ in range(case.log_every):
            step()
        sync()
        windows.append(time.perf_counter() - started)
    seconds = statistics.median(windows) / case.log_every
    tokens_per_s = case.grad_accum * case.batch_size * case.seq_len / seconds
    peak = peak_flops(device, precision=precision)
    return {"tokens_per_s": tokens_per_s,
            "mfu": flops_per_token(model_config, model.num_parameters()) * tokens_per_s / peak if peak else None,
            "data_wait_fraction": None, "step_time_s": seconds,
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            "final_step": None, "final_loss": None}


def free_device_memory() -> None:
    import gc

    gc.collect()
    with contextlib.suppress(ImportError):
        import torch
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# -- the rounds and the table ----------------------------------------------------------------------
def run_rounds(cases: list[Case], args: argparse.Namespace, data: dict[int, str]) -> dict[str, dict]:
    """Each case once per round, `--runs` rounds; a run whose case's first run would not fit in what is
    left of `--budget` is left out."""
    started = time.monotonic()
    results: dict[str, dict] = {case.name: {"runs": [], "left_out": 0} for case in cases}
    for round_index in range(args.runs):
        for case in cases:
            entry = results[case.name]
            took = entry.get("first_run_s")
            if took is not None and time.monotonic() - started + took > args.budget:
                entry["left_out"] += 1
                continue
            began = time.monotonic()
            if case.bare:
                figures = run_bare(case, args)
            else:
                run_dir = Path(args.data_dir) / "runs" / f"{case.name}-{round_index}"
                figures = run_trainer(case, args, data[case.seq_len], run_dir)
            free_device_memory()
            entry["runs"].append(figures)
            entry.setdefault("first_run_s", time.monotonic() - began)
    for entry in results.values():
        entry["median"] = {key: _median([run[key] for run in entry["runs"]]) for key in entry["runs"][0]} \
            if entry["runs"] else {}
    return results


def _median(values):
    values = [value for value in values if value is not None]
    return statistics.median(values) if values else None


def table(results: dict[str, dict], cases: list[Case]) -> str:
    lines = ["| case | runs | tokens/s | MFU | data wait | step time | peak memory | loss (step) | trainer/bare |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for case in cases:
        entry = results[case.name]
        m = entry["median"]
        if not m:
            lines.append(f"| {case.name} | 0 (left out: time budget) | | | | | | | |")
            continue
        bare = results.get(f"{case.name}-bare", {}).get("median", {}).get("tokens_per_s")
        ratio = f"{m['tokens_per_s'] / bare:.3f}" if bare else "-"
        percent = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
        loss = "-" if m["final_loss"] is None else f"{m['final_loss']:.3f} ({m['final_step']:.0f})"
        memory = "n/a" if m["peak_memory_gib"] is None else f"{m['peak_memory_gib']:.2f} GiB"
        lines.append(f"| {case.name} | {len(entry['runs'])} | {m['tokens_per_s']:,.0f} | {percent(m['mfu'])} | "
                     f"{percent(m['data_wait_fraction'])} | {1000 * m['step_time_s']:.1f} ms | {memory} | {loss} | "
                     f"{ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(case.name for case in CASES), help="comma-separated names")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, a few steps: the script end to end")
    parser.add_argument("--text", help="a corpus to build real-text datasets from (with --tokenizer)")
    parser.add_argument("--tokenizer", help="the GPT-2 tokenizer for --text (e.g. gpt2_hf_tokenizer.json)")
    parser.add_argument("--data", help="a GPT-2-tokenized shardkit dataset at seq_len 1024 (instead of --text)")
    parser.add_argument("--data-2048", help="the same at seq_len 2048 (the attention cases)")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3, help="rounds: each case runs this many times (budget allowing)")
    parser.add_argument("--budget", type=float, default=540, help="seconds: no run starts that would end past it")
    parser.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "shardkit-bench-train"))
    parser.add_argument("--out", default="bench_out/train-issue31.json")
    args = parser.parse_args(argv)
    if args.text and not args.tokenizer:
        parser.error("--text needs --tokenizer")
    chosen = set(args.cases.split(","))
    cases = [case for case in CASES if case.name in chosen]
    if args.smoke:
        cases = [smoke_case(case) for case in cases]
        args.device, args.precision, args.compile, args.num_workers = "cpu", "fp32", False, 0
        args.runs = min(args.runs, 1)
    data = datasets(args)
    results = run_rounds(cases, args, data)
    device = "cpu"
    with contextlib.suppress(ImportError):
        import torch
        if torch.cuda.is_available() and args.device != "cpu":
            device = torch.cuda.get_device_name(0)
    print(f"\n{device}, {args.precision}, compile={args.compile}, medians over runs\n{table(results, cases)}")
    commands = {case.name: ("bare loop (in this script)" if case.bare else shlex.join(
        launch_prefix(args.nproc) + trainer_options(case, args, data[case.seq_len], Path("RUN_DIR"))))
        for case in cases}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "device": device, "host": platform.node(), "precision": args.precision, "compile": args.compile,
        "data": "random tokens" if args.smoke or not (args.text or args.data) else (args.text or args.data),
        "bench_command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv),
        "cases": {case.name: dataclasses.asdict(case) | {"command": commands[case.name]} | results[case.name]
                  for case in cases}}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
