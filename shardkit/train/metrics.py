"""Per-step metrics: a concise stdout line, `RUN_DIR/metrics.jsonl`, TensorBoard when installed.

Model FLOPs utilisation (MFU) is achieved model FLOPs per second per device over the device's peak:

    MFU = flops_per_token * tokens_per_second_per_device / peak_flops

with `flops_per_token = 6N + 12 * n_layer * d_model * seq_len` (see `model.flops_per_token`). Only
the model's own arithmetic counts: activation-checkpoint recomputation does not, so turning it on
lowers MFU, as it should. The peaks below are dense (no sparsity) tensor-core figures from NVIDIA's
data sheets; fp32 runs are measured against the TF32 peak. MFU is "n/a" on CPUs and unknown GPUs.

The data-wait fraction is the time a step spent blocked on the loader's `next()` over the step's
wall time, averaged over ranks: near zero means the input pipeline keeps up.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

# (substring of torch.cuda.get_device_name(), bf16 dense peak, TF32 dense peak), FLOP/s; first match wins.
PEAK_FLOPS: tuple[tuple[str, float, float], ...] = (
    ("H200", 989e12, 494.5e12),
    ("H100 PCIe", 756e12, 378e12),
    ("H100 NVL", 835e12, 417.5e12),
    ("H100", 989e12, 494.5e12),  # SXM5, e.g. "NVIDIA H100 80GB HBM3"
    ("A100", 312e12, 156e12),
)


def peak_flops(device: torch.device, *, bf16: bool) -> float | None:
    """Peak FLOP/s of one device for the run's precision, or None (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, bf16_peak, tf32_peak in PEAK_FLOPS:
        if key in name:
            return bf16_peak if bf16 else tf32_peak
    logger.warning("no peak-FLOPs figure for %r: MFU will be reported as n/a", name)
    return None


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory so far: allocated GPU memory on CUDA, else the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def step_metrics(*, step: int, loss: float, lr: float, grad_norm: float, step_time: float, data_wait: float,
                 tokens: int, world_size: int, flops_per_token: float, peak: float | None,
                 memory_gib: float) -> dict[str, Any]:
    """One step's record (a pure function of the measurements, so it is testable)."""
    tokens_per_s = tokens / step_time if step_time > 0 else 0.0
    per_device = tokens_per_s / world_size
    return {
        "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
        "tokens_per_s": tokens_per_s, "tokens_per_s_per_device": per_device,
        "mfu": flops_per_token * per_device / peak if peak else None,
        "data_wait_fraction": min(1.0, data_wait / step_time) if step_time > 0 else 0.0,
        "step_time_s": step_time, "peak_memory_gib": memory_gib,
    }


def format_line(record: dict[str, Any], total_steps: int) -> str:
    mfu = "n/a" if record["mfu"] is None else f"{100 * record['mfu']:.1f}%"
    return (f"step {record['step']:>6}/{total_steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
            f"gnorm {record['grad_norm']:.3f} | {_si(record['tokens_per_s'])} tok/s "
            f"({_si(record['tokens_per_s_per_device'])}/dev) | mfu {mfu} | "
            f"data wait {100 * record['data_wait_fraction']:.1f}% | mem {record['peak_memory_gib']:.2f} GiB")


def _si(value: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop records after `last_step`: steps a crashed attempt ran past its last checkpoint are redone."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= last_step]
    path.write_text("".join(line + "\n" for line in kept))


class MetricsLogger:
    """Writes step and eval records on rank 0 (other ranks' calls are no-ops).

    Args:
        run_dir: the run directory; records go to `run_dir/metrics.jsonl`.
        is_main: whether this is rank 0.
        total_steps: for the progress in the stdout line.
        log_every: print every N steps (every step is written to the JSONL file).
        tensorboard: also write TensorBoard events if `tensorboard` is importable.
        resume_step: step the run resumed from; later records of an earlier attempt are dropped.
    """

    def __init__(self, run_dir: Path, *, is_main: bool, total_steps: int, log_every: int,
                 tensorboard: bool, resume_step: int = 0):
        self.is_main = is_main
        self.total_steps = total_steps
        self.log_every = log_every
        self.path = run_dir / "metrics.jsonl"
        self._file = None
        self._tb = None
        if not is_main:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        truncate_jsonl(self.path, resume_step)
        self._file = open(self.path, "a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                logger.info("tensorboard is not installed: metrics go to %s only", self.path)
            else:
                self._tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step + 1)

    def log(self, record: dict[str, Any], *, echo: bool | None = None) -> None:
        if not self.is_main:
            return
        record = {**record, "time": time.time()}
        self._file.write(json.dumps(record) + "\n")
        step = record["step"]
        if self._tb is not None:
            for key, value in record.items():
                if key not in ("step", "time") and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
        if echo if echo is not None else (step % self.log_every == 0 or step == self.total_steps or step == 1):
            line = format_line(record, self.total_steps) if "loss" in record else (
                f"step {step:>6}/{self.total_steps} | eval loss {record['eval_loss']:.4f}")
            print(line, flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


class SampleLog:
    """Per-rank log of the global sample ids each optimizer step consumed: `RUN_DIR/samples/rank-R.jsonl`."""

    def __init__(self, run_dir: Path, *, rank: int):
        self.directory = run_dir / "samples"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / f"rank-{rank}.jsonl"
        self._file = open(self.path, "a", buffering=1)
        self.rank = rank

    @staticmethod
    def truncate_all(run_dir: Path, last_step: int) -> None:
        """Rank 0, before the others open their logs: forget steps after the checkpoint resumed from
        (in every rank's file, including ranks of an earlier, larger world size)."""
        for path in (run_dir / "samples").glob("rank-*.jsonl"):
            truncate_jsonl(path, last_step)

    def log(self, step: int, sample_ids: list[int]) -> None:
        self._file.write(json.dumps({"step": step, "rank": self.rank, "ids": sample_ids}) + "\n")

    def close(self) -> None:
        self._file.close()
