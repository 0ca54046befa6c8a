"""`apply_compile`: `torch.compile` per transformer block in `--compile-mode`, CUDA graphs only where they are safe.

Per block, as torchtitan does: the twelve-odd blocks share one compiled graph (same code, same shapes),
so compilation costs one block, and FSDP's per-block hooks stay outside the graphs.

`reduce-overhead` and `max-autotune` also capture each block's kernels in a CUDA graph (torch's
CUDA graph trees): one launch per block instead of one per kernel, which pays where the CPU cannot
launch kernels as fast as the GPU runs them (small models, small micro-batches). A graph replays fixed
shapes at fixed memory addresses, so `cuda_graph_refusal` refuses the layouts where that breaks or
was not shown to hold, with the reason; `max-autotune-no-cudagraphs` tunes kernels without graphs and
goes wherever `default` goes.
"""

from __future__ import annotations

from torch import nn

from shardkit.train.config.compile import CUDA_GRAPH_MODES
from shardkit.train.model import blocks_of
from shardkit.train.parallel.mesh import ParallelDims


def cuda_graph_refusal(mode: str, *, device_type: str, dims: ParallelDims, activation_checkpointing: bool,
                       document_mask: bool) -> str | None:
    """Why `--compile-mode mode` cannot run in this layout, or None where it can (checked once the device
    and the mesh are resolved; `TrainConfig` and `CompileConfig` refuse what the options alone decide)."""
    if mode not in CUDA_GRAPH_MODES:
        return None
    reasons = [
        (device_type != "cuda", f"CUDA graphs need a CUDA device, this run uses {device_type}"),
        (dims.pp > 1, "the pipeline schedule runs stages between point-to-point sends of varying micro-batches"),
        (dims.dp_shard > 1, "FSDP gathers each block's parameters into new memory at every forward, and a graph "
                            "replays fixed addresses"),
        (dims.tp > 1, "tensor-parallel blocks run collectives on DTensors between their matmuls, not verified "
                      "under CUDA graphs"),
        (activation_checkpointing, "activation checkpointing replays a block's forward during the backward, and "
                                   "the replay overwrites the graph outputs the backward still needs"),
        (document_mask, "the document block mask is a new object built from every batch (not verified under CUDA "
                        "graphs)"),
    ]
    for refused, reason in reasons:
        if refused:
            return (f"--compile-mode {mode} captures CUDA graphs, which this run cannot use: {reason}; use "
                    "--compile-mode default or max-autotune-no-cudagraphs")
    return None


def apply_compile(model: nn.Module, mode: str) -> None:
    """Compile every block of `model` in place (its parameter names do not change)."""
    for block in blocks_of(model):
        block.compile(mode=None if mode == "default" else mode)
