"""Process group, device and model wrapping: DDP, FSDP2 and HSDP over the ranks torchrun starts.

The backend follows the device (NCCL for CUDA, gloo for CPU) unless `--backend` says otherwise. The
rank, world size and local layout come from torchrun's environment once, here, and are passed on as
arguments; nothing else reads them from ambient state.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardkit.train.config import ParallelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Runtime:
    """Where this process runs: rank layout, device and the resolved parallel mode."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    mode: str  # "none", "ddp", "fsdp" or "hsdp"

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def init_runtime(config: ParallelConfig, *, device: str = "auto") -> Runtime:
    """Join the process group torchrun describes (if any) and pick the device and parallel mode."""
    world_size = _env_int("WORLD_SIZE", 1)
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available")
    torch_device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(torch_device)
    mode = config.parallel
    if mode == "auto":
        mode = "ddp" if world_size > 1 else "none"
    if mode == "hsdp":
        shard = config.shard_size or local_world_size
        if world_size % shard:
            raise ValueError(f"--parallel hsdp: world size {world_size} is not a multiple of --shard_size {shard}")
    if world_size > 1 and mode == "none":
        raise ValueError(f"--parallel none runs one process, but torchrun started {world_size}; "
                         "use --parallel ddp, fsdp or hsdp")
    if world_size > 1 or mode != "none":
        if not dist.is_initialized():
            backend = config.backend if config.backend != "auto" else ("nccl" if use_cuda else "gloo")
            if "MASTER_ADDR" not in os.environ:  # one process without torchrun: a private group
                os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
                os.environ.setdefault("MASTER_PORT", str(_free_port()))
            timeout = datetime.timedelta(minutes=10)
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout,
                                    store=_attempt_store(world_size, timeout),
                                    device_id=torch_device if use_cuda else None)
            logger.info("rank %d/%d joined the %s process group on %s", rank, world_size, backend, torch_device)
    return Runtime(rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size,
                   device=torch_device, mode=mode)


def _attempt_store(world_size: int, timeout: datetime.timedelta):
    """Under torchrun's agent store, a store whose keys are private to this restart attempt; else None.

    torch 2.13's torchrun keeps one store across `--max-restarts` attempts and its workers use it
    without a per-attempt prefix, so after a restart a fast rank can read the address a rank of the
    previous attempt published and fail with gloo's "connectFullMesh ... Connection refused". The
    prefix (run id + restart count) makes every attempt rendezvous afresh.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"shardkit/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/attempt-{attempt}", store)


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wrap_model(model: nn.Module, runtime: Runtime, config: ParallelConfig, *, bf16: bool) -> nn.Module:
    """Wrap `model` (already on `runtime.device`) for the resolved parallel mode.

    FSDP2 shards each block, then the root (embeddings, final norm, tied output projection), so one
    block's parameters are gathered at a time. With bf16 on, FSDP computes in bf16 parameters and
    reduces gradients in fp32; DDP and single-process runs use autocast instead (see the loop).
    """
    if runtime.mode in ("none", "diloco"):  # diloco replicas train alone: shardkit.train.diloco syncs them
        return model
    if runtime.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        ddp = DistributedDataParallel(model, device_ids=[runtime.device.index] if runtime.device.type == "cuda" else None)
        _register_comm_hook(ddp, config)
        return ddp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if runtime.mode == "hsdp":
        shard = config.shard_size or runtime.local_world_size
        mesh = init_device_mesh(runtime.device.type, (runtime.world_size // shard, shard),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(runtime.device.type, (runtime.world_size,), mesh_dim_names=("shard",))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
              else MixedPrecisionPolicy())
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


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


def close_runtime() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
