"""Data parallelism over the mesh's dp dims: DDP (1-D replication) or FSDP2 / HSDP.

FSDP2 shards each block, then each root (embeddings, final norm, output projection), so one block's
parameters are gathered at a time. Over a tensor-parallel model its parameters become 2-D DTensors
(sharded over dp_shard, split over tp). With bf16 or fp16 on, FSDP computes in 16-bit parameters and
reduces gradients in fp32; DDP and single-process runs use autocast instead (see the loop).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from shardkit.train.config import ParallelConfig
from shardkit.train.model import blocks_of


def apply_ddp(model: nn.Module, device: torch.device, config: ParallelConfig) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    _register_comm_hook(ddp, config)
    return ddp


def apply_fsdp(roots: list[nn.Module], dp_mesh, *, param_dtype: torch.dtype | None = None) -> None:
    """Shard every block of every root in `roots` (the whole model, or this rank's pipeline stages), then the
    roots. With a 16-bit `param_dtype` the blocks compute in it and gradients are reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype is not None
              else MixedPrecisionPolicy())
    for root in roots:
        for block in blocks_of(root):
            fully_shard(block, mesh=dp_mesh, mp_policy=policy)
        fully_shard(root, mesh=dp_mesh, mp_policy=policy)


def _register_comm_hook(ddp: nn.Module, config: ParallelConfig) -> None:
    if config.comm_hook == "bf16":
        ddp.register_comm_hook(None, bf16_allreduce_hook)
    elif config.comm_hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        # Plain all-reduce for the first steps (PowerSGD's advice), then rank-r compression with
        # error feedback. The error-feedback buffers are not checkpointed: resumed runs are close, not exact.
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=config.powersgd_rank,
                                            start_powerSGD_iter=10)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def bf16_allreduce_hook(process_group, bucket):
    """DDP communication hook: all-reduce gradients in bf16 (half the bytes), then back to fp32.

    The same as torch's `default_hooks.bf16_compress_hook`, which DDP refuses (by name) except on NCCL or
    XCCL; this one also runs on gloo, so CPU tests exercise the path GPU clusters use.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)


def unwrap(model: nn.Module) -> nn.Module:
    """The underlying transformer (DDP keeps it in `.module`; FSDP2 modifies the module in place)."""
    return getattr(model, "module", model)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, mode: str, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce / reduce-scatter on non-final micro-steps of an accumulation."""
    if mode == "ddp" and not enabled:
        with model.no_sync():
            yield
    elif mode in ("fsdp", "hsdp"):
        model.set_requires_gradient_sync(enabled)
        yield
    else:
        yield


def reshard_after_eval(model: nn.Module, mode: str) -> None:
    """Free the gathered parameters a no-grad FSDP2 forward leaves behind (torch 2.13 keeps the root
    unsharded after a forward without backward; a state dict taken then would be wrong)."""
    if mode in ("fsdp", "hsdp"):
        for module in model.modules():
            if hasattr(module, "reshard") and hasattr(module, "set_requires_gradient_sync"):
                module.reshard()
