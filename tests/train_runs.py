"""Helpers for the multi-process trainer tests: a small real dataset and torchrun launches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from shardkit.formats import Sample, write_dataset
from shardkit.manifest import TokenizerInfo

REPO = Path(__file__).resolve().parents[1]
NUM_SAMPLES, SEQ_LEN = 96, 32  # 8 steps of a global batch of 12 consume exactly one epoch


def write_byte_dataset(url: str, *, num_samples: int = NUM_SAMPLES, seq_len: int = SEQ_LEN, seed: int = 0,
                       storage_options: dict | None = None, samples_per_shard: int = 16, **writer_options) -> None:
    """Byte-level packed samples cut from this repository's Python sources, two documents per sample."""
    text = b"".join(path.read_bytes() for path in sorted((REPO / "shardkit").rglob("*.py")))
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(num_samples):
        offset = int(rng.integers(0, len(text) - seq_len - 1))
        tokens = np.frombuffer(text[offset:offset + seq_len + 1], dtype=np.uint8).astype(np.uint16)
        cut = int(rng.integers(1, seq_len))
        samples.append(Sample(tokens, np.array([0, cut]), np.array([0, 0]), np.array([2 * i, 2 * i + 1])))
    write_dataset(url, samples, tokenizer=TokenizerInfo(kind="byte", name="byte", vocab_size=256),
                  seq_len=seq_len, packing="concat", max_samples=samples_per_shard, sources=("repository sources",),
                  storage_options=storage_options, **writer_options)


def write_gpt2_dataset(url: str, tokenizer_path: str, *, num_samples: int = 48, seq_len: int = SEQ_LEN) -> None:
    """Packed samples of this repository's Python sources tokenized with the real GPT-2 tokenizer (50257 ids)."""
    from shardkit.text.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    text = "".join(path.read_text() for path in sorted((REPO / "shardkit" / "train").rglob("*.py")))
    tokens = np.asarray(tokenizer.encode(text), dtype=np.uint16)
    samples = [Sample(tokens[i * seq_len:(i + 1) * seq_len + 1]) for i in range(num_samples)]
    write_dataset(url, samples, tokenizer=tokenizer.info, seq_len=seq_len, packing="concat", max_samples=16,
                  sources=("repository sources",))


def torchrun(run_dir: Path, data: str, *, nproc: int = 2, parallel: str = "ddp", batch_size: int = 6,
             steps: int = 8, checkpoint_every: int = 4, max_restarts: int = 0, fault: str | None = None,
             eval_data: str | None = None, extra: tuple[str, ...] = (), timeout: float = 120) -> subprocess.CompletedProcess:
    """Launch `torchrun -m shardkit.train` on CPU (gloo) and wait for it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("SHARDKIT_FAULT_INJECT", None)
    if fault:
        env["SHARDKIT_FAULT_INJECT"] = fault
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               "--max-restarts", str(max_restarts), "--monitor-interval", "0.2", "-m", "shardkit.train",
               "--data", data, "--steps", str(steps), "--batch-size", str(batch_size), "--warmup-steps", "2",
               "--checkpoint-every", str(checkpoint_every), "--keep", "5", "--log-sample-ids", "--log-every", "100",
               "--parallel", parallel, "--device", "cpu", "--run-dir", str(run_dir),
               "--cache-dir", str(run_dir.parent / "cache"), *extra]
    if eval_data:  # evaluated before the step-4 checkpoint: FSDP must reshard after the no-grad forward
        command += ["--eval-data", eval_data, "--eval-every", "4", "--eval-batches", "2"]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               cwd=run_dir.parent)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM lets torchrun stop its workers (they run in their own sessions); SIGKILL would orphan them.
        process.terminate()
        try:
            stdout, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        raise AssertionError(f"torchrun timed out after {timeout}s:\n{stdout[-3000:]}\n{stderr[-6000:]}") from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def check_ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    if result.returncode != 0:
        raise AssertionError(f"torchrun failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return result


def eval_losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}


def losses(run_dir: Path) -> dict[int, float]:
    """step -> global loss, from the run's metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert len(steps) == len(set(steps)), f"a step is logged twice in {run_dir}: {steps}"
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def loss_scales(run_dir: Path) -> dict[int, tuple[float, bool, int]]:
    """step -> (loss scale, overflowed, overflow-skipped steps so far) of an fp16 run's metrics.jsonl ({} otherwise)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss_scale"], r["overflow"], r["overflow_steps"]) for r in records if "loss_scale" in r}


def sample_ids(run_dir: Path) -> dict[int, list[int]]:
    """step -> sorted sample ids consumed by all ranks at that step."""
    by_step: dict[int, list[int]] = {}
    for path in sorted((run_dir / "samples").glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            by_step.setdefault(record["step"], []).extend(record["ids"])
    return {step: sorted(ids) for step, ids in sorted(by_step.items())}


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())
