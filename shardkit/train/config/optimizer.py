"""The optimizer section (`--lr`, `--schedule`, `--weight-decay`, ...), read by `shardkit.train.optim` to build
the inner optimizer and its learning-rate schedule."""

from __future__ import annotations

from dataclasses import dataclass

from shardkit.options import option
from shardkit.train.config.checks import check

OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("cosine", "wsd", "constant")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The (inner) optimizer, AdamW or plain SGD, and its learning-rate schedule."""

    optimizer_name: str = option("adamw", "'adamw', or 'sgd' (plain SGD, no momentum; weight decay is then "
                                 "coupled L2)", choices=OPTIMIZERS)
    lr: float = option(3e-4, "peak learning rate")
    min_lr_ratio: float = option(0.1, "final learning rate as a fraction of --lr")
    warmup_steps: int | None = option(None, "linear warm-up steps; default min(100, --steps // 10)")
    schedule: str = option("cosine", "after warm-up: 'cosine' decay, 'wsd' (warmup-stable-decay) or 'constant'",
                           choices=SCHEDULES)
    decay_fraction: float = option(0.2, "wsd: fraction of all steps spent in the final linear decay")
    weight_decay: float = option(0.1, "AdamW weight decay (matrices only; not norms, biases or embeddings)")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.95, "AdamW beta2")
    eps: float = option(1e-8, "AdamW epsilon")
    grad_clip: float = option(1.0, "clip the global gradient norm to this value (0 disables clipping)")

    def __post_init__(self) -> None:
        check(self.optimizer_name in OPTIMIZERS,
               f"--optimizer-name must be one of {OPTIMIZERS}, got {self.optimizer_name!r}")
        check(self.lr > 0, f"--lr must be positive, got {self.lr}")
        check(0 <= self.min_lr_ratio <= 1, f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        check(self.warmup_steps is None or self.warmup_steps >= 0,
               f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        check(self.schedule in SCHEDULES, f"--schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        check(0 < self.decay_fraction <= 1, f"--decay-fraction must be in (0, 1], got {self.decay_fraction}")
        check(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}")
        check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "--beta1 and --beta2 must be in [0, 1)")
        check(self.grad_clip >= 0, f"--grad-clip must be >= 0 (0 disables), got {self.grad_clip}")

