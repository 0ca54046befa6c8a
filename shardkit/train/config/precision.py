"""The mixed_precision section (`--precision` and fp16's loss scaling), read by `shardkit.train.precision`:
`choose_precision` resolves 'auto', `build_loss_scaler` takes the scale, its growth and the overflow limit."""

from __future__ import annotations

from dataclasses import dataclass

from shardkit.options import option
from shardkit.train.config.checks import FLOAT32_MAX, FLOAT32_TINY, MAX_OVERFLOW_STEPS, check

PRECISIONS = ("auto", "bf16", "fp16", "fp32")


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """The dtype the model computes in, and fp16's dynamic loss scaling."""

    precision: str = option("auto", "'bf16' or 'fp16' autocast / FSDP mixed precision (fp32 master weights and "
                            "optimizer; fp16 with dynamic loss scaling), 'fp32', or 'auto' (bf16 on GPUs with native "
                            "bf16, fp16 on older GPUs, fp32 on CPU; the log says which and why)", choices=PRECISIONS)
    loss_scale: float = option(65536.0, "fp16: initial loss scale; halved at every step whose gradients overflow "
                               "(that step's update is skipped), doubled after --loss-scale-growth-interval clean "
                               "steps in a row")
    loss_scale_growth_interval: int = option(2000, "fp16: clean steps in a row before the loss scale doubles")
    max_overflow_steps: int = option(
        MAX_OVERFLOW_STEPS, "fp16: stop the run (exit 1) after this many optimizer steps in a row whose gradients "
        "overflowed: the scale has been halved that often (it stops at a floor of min(1, --loss-scale)), so the "
        "inf/NaN comes from the model, not from fp16's range; resume from the last checkpoint with a lower --lr, "
        "--skip-steps over the bad batches, or --precision bf16")

    def __post_init__(self) -> None:
        check(self.precision in PRECISIONS, f"--precision must be one of {PRECISIONS}, got {self.precision!r}")
        # The scale lives in a float32 tensor: 1e39 would be inf there, 1e-39 a subnormal that turns the
        # gradients into NaN.
        check(FLOAT32_TINY <= self.loss_scale <= FLOAT32_MAX,
              f"--loss-scale must be a normal float32 number, between {FLOAT32_TINY:.4g} and {FLOAT32_MAX:.4g}, "
              f"got {self.loss_scale:g}")
        check(self.loss_scale_growth_interval >= 1,
              f"--loss-scale-growth-interval must be >= 1, got {self.loss_scale_growth_interval}")
        check(self.max_overflow_steps >= 1, f"--max-overflow-steps must be >= 1, got {self.max_overflow_steps}")
        scaling = (self.loss_scale, self.loss_scale_growth_interval, self.max_overflow_steps)
        check(self.precision in ("fp16", "auto") or scaling == (65536.0, 2000, MAX_OVERFLOW_STEPS),
              "--loss-scale, --loss-scale-growth-interval and --max-overflow-steps apply to --precision fp16 only, "
              f"not {self.precision}")
