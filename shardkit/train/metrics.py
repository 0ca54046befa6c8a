"""Per-step metrics: a concise stdout line, `RUN_DIR/metrics.jsonl`, TensorBoard when installed.

Model FLOPs utilisation (MFU) is achieved model FLOPs per second per device over the device's peak:

    MFU = flops_per_token * tokens_per_second_per_device / peak_flops

with `flops_per_token = 6N + 12 * n_layer * d_model * seq_len` (see `model.flops_per_token`). Only
the model's own arithmetic counts: activation-checkpoint recomputation does not, so turning it on
lowers MFU, as it should. The peaks below are dense (no sparsity) tensor-core figures from NVIDIA's
data sheets; fp32 runs are measured against the TF32 peak. MFU is "n/a" on CPUs and unknown GPUs.

Tokens per step count each data-parallel batch once (tensor and pipeline peers of one dp rank
process the same tokens), and the per-device rate divides by every device of the mesh, so MFU is
per device whatever the layout.

The data-wait fraction is the time a step spent blocked on the loader's `next()` over the step's
wall time, averaged over ranks: near zero means the input pipeline keeps up.

Communication per step (`comm_bytes_*`) is measured, not estimated: `CollectiveCounter` sees every
collective this rank issues (c10d ops from FSDP, DDP and pipeline send/recv, and the functional
collectives DTensor uses for tensor parallelism) and adds up the bytes of each (see `collective_bytes`).
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
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from shardkit.options import format_size
from shardkit.records import read_records
from shardkit.storage import write_file_atomic
from shardkit.train.precision import PrecisionChoice

logger = logging.getLogger(__name__)

# (substring of torch.cuda.get_device_name(), 16-bit (bf16/fp16) dense tensor-core peak, fp32 peak (TF32
# where the GPU has it)), FLOP/s; first match wins. V100 and T4 have no bf16: their 16-bit figure is fp16's.
PEAK_FLOPS: tuple[tuple[str, float, float], ...] = (
    ("H200", 989e12, 494.5e12),
    ("H100 PCIe", 756e12, 378e12),
    ("H100 NVL", 835e12, 417.5e12),
    ("H100", 989e12, 494.5e12),  # SXM5, e.g. "NVIDIA H100 80GB HBM3"
    ("A100", 312e12, 156e12),
    ("V100-PCIE", 112e12, 14e12),
    ("V100", 125e12, 15.7e12),  # SXM2
    ("T4", 65e12, 8.1e12),
)


def peak_flops(device: torch.device, *, precision: PrecisionChoice) -> float | None:
    """Peak FLOP/s of one device for the run's precision, or None (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, half_peak, fp32_peak in PEAK_FLOPS:
        if key in name:
            return half_peak if precision.sixteen_bit else fp32_peak
    logger.warning("no peak-FLOPs figure for %r: MFU will be reported as n/a", name)
    return None


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory so far: allocated GPU memory on CUDA, else the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


# Collective op name (c10d's in-place ops and the functional ops DTensor issues) -> reported kind.
COLLECTIVE_KINDS: dict[str, str] = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "allgather_": "all_gather", "_allgather_base_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "send": "send_recv", "recv_": "send_recv", "recv_any_source_": "send_recv",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all",
}
COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "broadcast", "all_to_all")


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def collective_bytes(args: tuple, output: Any) -> int:
    """Bytes of the full buffer one collective works on, as this rank sees it: the reduced tensor of an
    all-reduce, the gathered output of an all-gather, the input of a reduce-scatter, the tensor sent or
    received. That is the largest tensor argument (or output, for functional all-gathers)."""
    return max([_tensor_bytes(arg) for arg in args] + [_tensor_bytes(output)])


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives issued under it and the bytes each kind moves (`counts`, `bytes`).

    A dispatch mode, so it sees the ops of every library that issues collectives through the
    dispatcher (FSDP2, DDP's reducer, pipelining's send/recv, DTensor). Barriers are not counted.
    """

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = dict.fromkeys(COMM_KINDS, 0)
        self.bytes: dict[str, int] = dict.fromkeys(COMM_KINDS, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(getattr(t, "__name__", "") == "DTensor" for t in types):
            # Modes run before tensor subclasses: let DTensor turn the op into local ops and
            # collectives first, which then come back here (as CommDebugMode does).
            return NotImplemented
        output = func(*args, **(kwargs or {}))
        namespace = func.namespace
        if namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            kind = COLLECTIVE_KINDS.get(func.__name__.split(".")[0])
            if kind is not None:
                self.counts[kind] += 1
                self.bytes[kind] += collective_bytes(args, output)
        return output

    def record(self) -> dict[str, int]:
        """`comm_bytes_KIND` and `comm_count_KIND` for every kind seen (for metrics.jsonl)."""
        record: dict[str, int] = {}
        for kind in COMM_KINDS:
            if self.counts[kind]:
                record[f"comm_bytes_{kind}"] = self.bytes[kind]
                record[f"comm_count_{kind}"] = self.counts[kind]
        return record


def step_metrics(*, step: int, loss: float, lr: float, grad_norm: float, step_time: float, data_wait: float,
                 tokens: int, world_size: int, flops_per_token: float, peak: float | None,
                 memory_gib: float, comm: dict[str, int] | None = None) -> dict[str, Any]:
    """One step's record (a pure function of the measurements, so it is testable).

    Args:
        tokens: tokens the whole mesh trained on this step (each data-parallel batch once).
        world_size: all devices of the mesh (MFU and the per-device rate are per device).
        comm: `CollectiveCounter.record()` of this step, if counted.
    """
    tokens_per_s = tokens / step_time if step_time > 0 else 0.0
    per_device = tokens_per_s / world_size
    return {**(comm or {}),
        "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
        "tokens_per_s": tokens_per_s, "tokens_per_s_per_device": per_device,
        "mfu": flops_per_token * per_device / peak if peak else None,
        "data_wait_fraction": min(1.0, data_wait / step_time) if step_time > 0 else 0.0,
        "step_time_s": step_time, "peak_memory_gib": memory_gib,
    }


class PendingSteps:
    """The records of the steps since the last sync point, their numbers still where they were computed.

    On a GPU, turning a tensor into a Python number makes the host wait for every kernel queued before it,
    so the next step's kernels are launched only once the device has gone idle. The loop therefore keeps
    each step's loss and gradient norm as device tensors (and its data wait and timing as host numbers)
    and reads them all at once at a sync point: one all-reduce (the ranks' mean loss and data wait, and
    the flags the ranks must agree on) and one conversion, whatever the number of steps.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._steps: list[tuple[dict[str, Any], dict[str, Any], torch.Tensor | None, torch.Tensor | None]] = []

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, measured: dict[str, Any], *, loss: torch.Tensor, grad_norm: torch.Tensor,
            extra: dict[str, Any]) -> None:
        """A trained step: `step_metrics`' arguments but loss and grad norm, which stay tensors until
        `resolve`; `extra` joins the record as it is."""
        self._steps.append((measured, extra, loss.detach().reshape(()).float(), grad_norm.detach().reshape(()).float()))

    def add_record(self, record: dict[str, Any]) -> None:
        """A record without device numbers (a skipped step), kept in step order with the others."""
        self._steps.append(({}, record, None, None))

    def resolve(self, flags: list[float], *, world_size: int, distributed: bool
                ) -> tuple[list[dict[str, Any]], list[float]]:
        """The pending records, complete, and `flags` summed over the ranks; empties the buffer.

        Losses and data waits are averaged over the ranks (pipeline stages other than the last report a
        zero loss and the last one pp times its loss, so the mean is the global loss); gradient norms are
        this rank's (the same on every rank, except DiLoCo's replicas).

        On a GPU the host runs ahead of the device, so a step's own time is the host's; the wait here for
        the work queued since the last sync point is added to the last step, so that the times of the
        steps between two sync points add up to the wall time they took."""
        started = time.perf_counter()
        trained = [entry for entry in self._steps if entry[2] is not None]
        shared = torch.stack([loss for _, _, loss, _ in trained]) if trained else torch.zeros(0, device=self.device)
        norms = torch.stack([norm for _, _, _, norm in trained]) if trained else torch.zeros(0, device=self.device)
        waits = [measured["data_wait"] for measured, _, _, _ in trained]
        if distributed:
            host = torch.tensor(waits + list(flags), dtype=torch.float32).to(self.device)
            shared = torch.cat([shared, host])
            dist.all_reduce(shared)
            values = torch.cat([shared, norms]).tolist()
            count = len(trained)
            means = [value / world_size for value in values[:2 * count]]
            losses, waits = means[:count], means[count:]
            flags = values[2 * count:2 * count + len(flags)]
            grad_norms = values[2 * count + len(flags):]
        else:
            values = torch.cat([shared, norms]).tolist() if trained else []
            losses, grad_norms = values[:len(trained)], values[len(trained):]
        if trained:
            trained[-1][0]["step_time"] += time.perf_counter() - started
        numbers = iter(zip(losses, grad_norms, waits))
        records = []
        for measured, extra, loss, _ in self._steps:
            if loss is None:
                records.append(extra)
                continue
            loss_value, norm_value, wait_value = next(numbers)
            records.append(step_metrics(**{**measured, "data_wait": wait_value}, loss=loss_value,
                                        grad_norm=norm_value) | extra)
        self._steps = []
        return records, list(flags)


def format_line(record: dict[str, Any], total_steps: int) -> str:
    mfu = "n/a" if record["mfu"] is None else f"{100 * record['mfu']:.1f}%"
    comm = " ".join(f"{kind.replace('_', '-')} {format_size(record[f'comm_bytes_{kind}'])}" for kind in COMM_KINDS
                    if record.get(f"comm_bytes_{kind}"))
    return (f"step {record['step']:>6}/{total_steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
            f"gnorm {record['grad_norm']:.3f} | {_si(record['tokens_per_s'])} tok/s "
            f"({_si(record['tokens_per_s_per_device'])}/dev) | mfu {mfu} | "
            f"data wait {100 * record['data_wait_fraction']:.1f}% | mem {record['peak_memory_gib']:.2f} GiB"
            + (f" | comm {comm}" if comm else "")
            + (f" | loss scale {record['loss_scale']:g}, {record['overflow_steps']} overflow-skipped"
               if "loss_scale" in record else ""))


def _si(value: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop records after `last_step`: steps a crashed attempt ran past its last checkpoint are redone."""
    if not path.exists():
        return
    # A torn last record (a crash mid-append) is dropped with a warning; damage elsewhere names file and line.
    kept = [record for _, record in read_records(path) if record.get("step", 0) <= last_step]
    # Replaced, not rewritten in place: a reader following the file as it grows (the tuner) sees a new file,
    # never its old offset pointing into the middle of the shorter new content.
    write_file_atomic(str(path), "".join(json.dumps(record) + "\n" for record in kept).encode())


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
        record = {**record, "time": record.get("time", time.time())}
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


STREAMS_LOG = "streams.jsonl"


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

    @staticmethod
    def record_streams(run_dir: Path, step: int, streams: list[dict[str, Any]]) -> None:
        """Rank 0, at every start: the streams whose global sample ids the steps after `step` log
        (`samples/streams.jsonl`; a resume with another mixture numbers ids through other streams)."""
        path = run_dir / "samples" / STREAMS_LOG
        path.parent.mkdir(parents=True, exist_ok=True)
        truncate_jsonl(path, step)
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"step": step, "streams": streams}) + "\n")

    def log(self, step: int, sample_ids: list[int], *, skipped: bool = False) -> None:
        record = {"step": step, "rank": self.rank, "ids": sample_ids} | ({"skipped": True} if skipped else {})
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()
