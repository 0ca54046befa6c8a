"""The compile section (`--compile`, `--compile-mode`, `--activation-checkpointing`): how each transformer
block is wrapped before training, read by `shardkit.train.parallel.parallelize` (apply_compile, apply_ac) and
`shardkit.train.parallel.compile` (the CUDA-graph refusals once the layout and device are known)."""

from __future__ import annotations

from dataclasses import dataclass

from shardkit.options import option
from shardkit.train.config.checks import check

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# The modes that capture CUDA graphs (fixed shapes, no gradient accumulation over micro-steps).
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


@dataclass(frozen=True, kw_only=True)
class CompileConfig:
    """torch.compile and activation checkpointing of the transformer blocks."""

    compile: bool = option(False, "torch.compile each transformer block")
    compile_mode: str = option("default", "torch.compile mode with --compile: 'reduce-overhead' and 'max-autotune' "
                               "also capture CUDA graphs (single GPU or DDP, one micro-step per step, no activation "
                               "checkpointing or document masking; refused elsewhere with the reason), "
                               "'max-autotune-no-cudagraphs' tunes kernels without them", choices=COMPILE_MODES)
    activation_checkpointing: bool = option(False, "recompute block activations in the backward pass")

    def __post_init__(self) -> None:
        check(self.compile_mode in COMPILE_MODES,
              f"--compile-mode must be one of {COMPILE_MODES}, got {self.compile_mode!r}")
        check(self.compile or self.compile_mode == "default", f"--compile-mode {self.compile_mode} needs --compile")
