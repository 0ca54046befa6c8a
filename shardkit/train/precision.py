"""Which floating-point precision a run computes in, and FP16's dynamic loss scaling.

`choose_precision` is a pure function of the request and two facts about the device (its type and
whether it has native bf16), so every branch of `--precision auto` is testable without the device.

FP16 has five exponent bits: gradients below ~6e-8 underflow to zero. `LossScaler` multiplies the loss
by a scale S before the backward pass (so gradients are S times larger and stay representable), divides
the gradients by S before clipping and the update, and adapts S: a step whose gradients hold an inf or
a NaN is skipped and S halves; after `--loss-scale-growth-interval` clean steps in a row S doubles. It is
torch's `GradScaler` where every rank holds the same whole gradients (one process, DDP after its
all-reduce), and `ShardedGradScaler` wherever a rank holds only part of them (FSDP2/HSDP shards, tensor-
parallel slices, pipeline stages) or its own (DiLoCo replicas): that one all-reduces the overflow flag
over all ranks, so every rank skips the same steps and keeps the same scale.

Two guards keep a diverged run from going on for nothing: the scale never drops below a floor
(min(1, --loss-scale); halving forever reached 0.0, from which no growth recovers), and after
`--max-overflow-steps` overflowing steps in a row the run stops with `TooManyOverflows` (exit 1): by then
the scale has been halved so often that the inf/NaN comes from the model itself, not from fp16's range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

COMPUTE_DTYPES: dict[str, torch.dtype | None] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision a run computes in ('bf16', 'fp16' or 'fp32') and why (for the log)."""

    name: str
    reason: str

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The autocast / FSDP parameter dtype, or None for fp32."""
        return COMPUTE_DTYPES[self.name]

    @property
    def sixteen_bit(self) -> bool:
        """Whether the forward and backward run in 16 bits (on the 16-bit tensor-core peak)."""
        return self.compute_dtype is not None

    @property
    def loss_scaling(self) -> bool:
        """Whether gradients need dynamic loss scaling (fp16's narrow exponent range)."""
        return self.name == "fp16"


def choose_precision(requested: str, *, device_type: str, native_bf16: bool) -> PrecisionChoice:
    """The precision for `--precision requested` on a device of type `device_type` ('cuda', 'cpu').

    Args:
        requested: 'auto', 'bf16', 'fp16' or 'fp32'.
        device_type: the torch device type the run trains on.
        native_bf16: whether that device computes bf16 natively (CUDA compute capability >= 8.0).
    """
    if requested != "auto":
        note = ""
        if requested == "bf16" and device_type == "cuda" and not native_bf16:
            note = " (this GPU has no native bf16: it is emulated and slow; --precision fp16 is faster)"
        return PrecisionChoice(requested, f"asked for by --precision {requested}{note}")
    if device_type == "cuda" and native_bf16:
        return PrecisionChoice("bf16", "--precision auto: the GPU computes bf16 natively")
    if device_type == "cuda":
        return PrecisionChoice("fp16", "--precision auto: the GPU has no native bf16 (compute capability below "
                                       "8.0), so fp16 with dynamic loss scaling")
    return PrecisionChoice("fp32", f"--precision auto: on {device_type}, 16-bit autocast does not pay off")


def device_has_native_bf16(device: torch.device) -> bool:
    """The capability fact `choose_precision` needs, read from the device (False off CUDA)."""
    return device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)


class TooManyOverflows(FloatingPointError):
    """fp16: too many optimizer steps in a row overflowed; the run cannot make progress."""


class LossScaler:
    """Dynamic loss scaling around one optimizer, over torch's (Sharded)GradScaler.

    The training loop multiplies each micro-step's loss by `scale` (with its 1/grad_accum), then calls
    `unscale_` before clipping and `step` instead of `optimizer.step()`.

    Args:
        scaler: a `torch.amp.GradScaler` or `ShardedGradScaler`.
        device: the device the scale lives on.
        min_scale: the floor of the scale.
        max_overflow_steps: overflowing steps in a row after which `check` raises.
    """

    def __init__(self, scaler: torch.amp.GradScaler, device: torch.device, *, min_scale: float = 1.0,
                 max_overflow_steps: int = 32):
        self.scaler = scaler
        self.min_scale = min_scale
        self.max_overflow_steps = max_overflow_steps
        self.overflows_in_a_row = 0
        # GradScaler creates its scale tensor on the first scale(); unscale_ and load need it before.
        scaler.scale(torch.ones((), device=device))
        self.overflow_steps = 0  # steps skipped for overflowing gradients over the whole run (resumed too)
        self.last_scale = self.scale
        self.last_overflow = False

    @property
    def scale(self) -> float:
        """The current scale (a power of two times the initial one, so products with it are exact)."""
        return self.scaler.get_scale()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale and record (agreed over all ranks) whether any overflowed."""
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """The optimizer step unless the gradients overflowed, then the scale update. Returns whether
        the step was applied."""
        self.last_scale = self.scale
        self.scaler.step(optimizer)
        self.scaler.update()
        # update() multiplies the scale by backoff_factor (< 1) exactly when the step was skipped.
        scale = self.scale
        self.last_overflow = scale < self.last_scale
        if scale < self.min_scale:
            self.scaler.update(self.min_scale)
        self.overflow_steps += self.last_overflow
        self.overflows_in_a_row = self.overflows_in_a_row + 1 if self.last_overflow else 0
        return not self.last_overflow

    def check(self, step: int) -> None:
        """Raise `TooManyOverflows` once `max_overflow_steps` steps in a row up to `step` overflowed."""
        if self.overflows_in_a_row >= self.max_overflow_steps:
            raise TooManyOverflows(
                f"fp16: the gradients of the last {self.overflows_in_a_row} optimizer steps (up to step {step}) "
                f"overflowed although the loss scale went down to {self.scale:g} (--max-overflow-steps "
                f"{self.max_overflow_steps}): the model diverged (inf/NaN at any scale); resume from the last "
                "checkpoint with a lower --lr, --skip-steps over these steps, or --precision bf16")

    def step_metrics(self) -> dict[str, Any]:
        """The last step's scale (the one its backward used), whether it overflowed, and the run's total."""
        return {"loss_scale": self.last_scale, "overflow": self.last_overflow, "overflow_steps": self.overflow_steps}

    def state_dict(self) -> dict[str, Any]:
        """A few JSON scalars (the checkpoint marker holds them): scale, growth tracker, skipped steps."""
        state = self.scaler.state_dict()
        return {"scale": state["scale"], "growth_tracker": state["_growth_tracker"],
                "overflow_steps": self.overflow_steps, "overflows_in_a_row": self.overflows_in_a_row}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s values; the growth interval and factors stay this run's options."""
        current = self.scaler.state_dict()
        self.scaler.load_state_dict({**current, "scale": float(state["scale"]),
                                     "_growth_tracker": int(state["growth_tracker"])})
        self.overflow_steps = int(state["overflow_steps"])
        self.overflows_in_a_row = int(state.get("overflows_in_a_row", 0))  # absent from older checkpoints
        self.last_scale = self.scale


def build_loss_scaler(precision: PrecisionChoice, *, device: torch.device, agree_over_ranks: bool, init_scale: float,
                      growth_interval: int, max_overflow_steps: int = 32) -> LossScaler | None:
    """The loss scaler of a run computing in `precision` (None unless it needs loss scaling).

    Args:
        agree_over_ranks: whether a rank holds only part of the gradients, or its own, so that the ranks
            must agree on an overflow (`Runtime.ranks_hold_partial_gradients`).
    """
    if not precision.loss_scaling:
        return None
    options = {"init_scale": init_scale, "growth_interval": growth_interval}
    if agree_over_ranks:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler(device.type, process_group=dist.group.WORLD, **options)
    else:
        scaler = torch.amp.GradScaler(device.type, **options)
    return LossScaler(scaler, device, min_scale=min(1.0, init_scale), max_overflow_steps=max_overflow_steps)
