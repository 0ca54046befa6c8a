"""Process group, device and device mesh for the ranks torchrun starts.

The backend follows the device (NCCL for CUDA, gloo for CPU) unless `--backend` says otherwise. The
rank, world size and local layout come from torchrun's environment once, here, and are passed on as
arguments; nothing else reads them from ambient state.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardkit.train.config import ParallelConfig
from shardkit.train.parallel.mesh import ParallelDims, build_mesh, resolve_dims

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Runtime:
    """Where this process runs: rank layout, device, the mesh sizes and the mesh itself."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    dims: ParallelDims
    mesh: Any = None  # a DeviceMesh with dims pp, dp_replicate, dp_shard, tp (+ flattened dp); None alone

    @property
    def mode(self) -> str:
        """How the data-parallel dims are applied: 'none', 'ddp', 'fsdp', 'hsdp' or 'diloco'."""
        return self.dims.data_parallel

    @property
    def casts_parameters(self) -> bool:
        """Whether the data-parallel wrapper casts the parameters to the compute dtype itself (FSDP2's
        MixedPrecisionPolicy); the other layouts compute in 16 bits under autocast."""
        return self.mode in ("fsdp", "hsdp")

    def autocast(self, dtype: torch.dtype | None):
        """The autocast context for a forward pass in `dtype` (None: fp32), off where FSDP2 casts."""
        return torch.autocast(self.device.type, dtype=dtype or torch.float32,
                              enabled=dtype is not None and not self.casts_parameters)

    @property
    def ranks_hold_partial_gradients(self) -> bool:
        """Whether a rank holds only part of the gradients (FSDP/HSDP shards, tensor-parallel slices,
        pipeline stages) or its own (DiLoCo replicas) rather than the same whole gradients as every
        other rank (one process, DDP after its all-reduce): then the ranks must agree on an fp16 overflow."""
        return self.distributed and (self.dims.tp > 1 or self.dims.pp > 1 or self.mode not in ("none", "ddp"))

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel coordinate: TP and PP peers share it (and read the same batches)."""
        return self.mesh.get_local_rank("dp") if self.mesh is not None else 0

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def dp_local_world_size(self) -> int:
        """Data-parallel coordinates on this node (tp and pp are innermost, so a node holds whole groups)."""
        per_node = max(1, self.local_world_size // (self.dims.tp * self.dims.pp))
        return per_node if self.dp_size % per_node == 0 else self.dp_size

    def group(self, name: str):
        """The process group of mesh dim `name` ('tp', 'pp', 'dp', ...), or None without a mesh."""
        return self.mesh.get_group(name) if self.mesh is not None else None

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def init_runtime(config: ParallelConfig, *, device: str = "auto", batch_size: int = 1) -> Runtime:
    """Check the layout, join the process group torchrun describes (if any), pick the device, build the mesh."""
    world_size = _env_int("WORLD_SIZE", 1)
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available")
    torch_device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(torch_device)
    if rank == 0:
        warn_if_nodes_cannot_rejoin()
    # Before any process-group work: an impossible layout is a message naming the option, not a hang.
    dims = resolve_dims(config, world_size=world_size, local_world_size=local_world_size, batch_size=batch_size)
    mesh = None
    if world_size > 1 or config.parallel not in ("none", "auto"):
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
        mesh = build_mesh(dims, torch_device.type)
    else:  # the same line as a group member's, so a log tells when each attempt's workers were ready
        logger.info("rank %d/%d runs alone on %s (no process group)", rank, world_size, torch_device)
    return Runtime(rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size,
                   device=torch_device, dims=dims, mesh=mesh)


REJOIN_VARIABLE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def warn_if_nodes_cannot_rejoin() -> bool:
    """Warn (and return True) when torchrun's agent shares its rendezvous store with the workers in a job whose
    membership can change: a node that leaves then never rejoins (docs/PARALLELISM.md, "Elastic training").

    The agent tells its workers `TORCHELASTIC_USE_AGENT_STORE=True` unless every agent runs with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; membership can change when restarts are allowed or several
    nodes take part (a single-node run without restarts has no node to lose, so it stays quiet).
    """
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and os.environ.get(REJOIN_VARIABLE) != "1"
    elastic = _env_int("TORCHELASTIC_MAX_RESTARTS", 0) > 0 or _env_int("GROUP_WORLD_SIZE", 1) > 1
    if not (shared and elastic):
        return False
    logger.warning("torchrun's agent shares its rendezvous store with the workers: a node that leaves will never "
                   "rejoin this job; export %s=1 on every node before torchrun (docs/PARALLELISM.md, \"Elastic "
                   "training\")", REJOIN_VARIABLE)
    return True


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


def close_runtime() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
