"""Who am I: the data-parallel rank, world size and node-local rank of this process.

Resolved lazily, when iteration starts, so a dataset created before `init_process_group` still
sees the right group. Precedence: explicit arguments, then a passed process group or DeviceMesh
dimension, then the initialised default torch.distributed group, then the RANK / WORLD_SIZE /
LOCAL_RANK / LOCAL_WORLD_SIZE environment (torchrun sets them), else a single process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Data-parallel position of one process.

    Attributes:
        rank: data-parallel rank.
        world_size: data-parallel ranks.
        local_rank: rank among the processes of this node.
        local_world_size: processes of this node (ranks are numbered node by node).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} / world_size {self.world_size}: need 0 <= rank < world_size")
        if self.local_world_size < 1 or not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(f"local_rank {self.local_rank} / local_world_size {self.local_world_size}: "
                             "need 0 <= local_rank < local_world_size")
        if self.world_size % self.local_world_size:
            raise ValueError(f"world_size {self.world_size} is not a multiple of local_world_size "
                             f"{self.local_world_size} (ranks must be spread evenly over nodes)")

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def node(self) -> int:
        return self.rank // self.local_world_size


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def process_group_ready() -> bool:
    """True when torch.distributed has an initialised default process group (the ranks can agree)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _from_group(process_group: Any, device_mesh: Any, mesh_dim: Any) -> tuple[int, int] | None:
    import torch.distributed as dist

    if device_mesh is not None:
        group = device_mesh.get_group(mesh_dim) if mesh_dim is not None else device_mesh.get_group()
        return dist.get_rank(group), dist.get_world_size(group)
    if process_group is not None:
        return dist.get_rank(process_group), dist.get_world_size(process_group)
    if process_group_ready():
        return dist.get_rank(), dist.get_world_size()
    return None


def check_topology_args(**values: int | None) -> None:
    """Explicit rank layout arguments: integers, sizes >= 1 and ranks >= 0 (None = resolve later).

    Raises:
        TypeError: a value that is not an integer, naming the argument.
        ValueError: a size below 1 or a negative rank, naming the argument.
    """
    for name, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
        low = 1 if name.endswith("world_size") else 0
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")


def resolve_topology(*, rank: int | None = None, world_size: int | None = None, local_rank: int | None = None,
                     local_world_size: int | None = None, process_group: Any = None, device_mesh: Any = None,
                     mesh_dim: Any = None) -> Topology:
    """Resolve the topology now (see the module docstring for the precedence)."""
    check_topology_args(rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size)
    if (rank is None) != (world_size is None):
        raise ValueError("pass both rank and world_size, or neither")
    env_world = _env_int("WORLD_SIZE")
    if rank is None:
        found = _from_group(process_group, device_mesh, mesh_dim)
        if found is None and env_world is not None:
            found = (_env_int("RANK") or 0, env_world)
        rank, world_size = found if found is not None else (0, 1)
    if local_world_size is None:
        env_local = _env_int("LOCAL_WORLD_SIZE")
        # The environment describes the whole job; trust it only when this is the whole job.
        if env_local is not None and env_world == world_size and world_size % env_local == 0:
            local_world_size = env_local
        else:
            local_world_size = world_size  # unknown layout: one node
    if local_rank is None:
        local_rank = rank % local_world_size
    return Topology(rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size)


def data_parallel_group(*, process_group: Any = None, device_mesh: Any = None, mesh_dim: Any = None) -> Any:
    """The data-parallel process group a dataset was given (a mesh's dimension, or the group; None: the default
    group): what ranks gather and agree over."""
    if device_mesh is not None:
        return device_mesh.get_group(mesh_dim) if mesh_dim is not None else device_mesh.get_group()
    return process_group
