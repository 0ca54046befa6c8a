"""The staging of a background save (`--async-save`) into buffers kept from save to save.

DCP's own stager walks the state dict in Python and copies tensor by tensor (~0.08 ms a tensor), and DCP's
writer process receives every staged tensor as a shared-memory handle of its own (a file descriptor passed per
tensor, through a thread of the trainer that holds the GIL meanwhile). `FlatStager` instead copies every tensor
of the state with one `torch._foreach_copy_` into views of one shared-memory buffer per dtype, allocated at the
first save and reused (a save first waits for the previous one to be written, so a buffer is never overwritten
while the writer reads it). What it hands DCP is a compact form, the buffers plus a layout (where each tensor
lies, and the non-tensor values), so that one handle per dtype crosses to the writer process;
`checkpoint_writer.ExpandingSavePlanner` turns it back into the state dict there, before DCP plans the save, so
the checkpoint on disk is the one a synchronous save writes.

It serves states whose tensors are all plain CPU tensors (one device, DDP: the tiny model on CPU); a state with
DTensors (FSDP, tensor parallel) or device tensors is staged by DCP's stager (`flat_stageable`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager

from shardkit.train.checkpoint_writer import FLAT_STATE_KEY

Path = tuple[str, ...]


def _leaves(state: dict[str, Any], prefix: Path = ()) -> list[tuple[Path, Any]]:
    """(path of keys, value) of every leaf of a state of nested dicts with string keys."""
    found = []
    for key, value in state.items():
        if isinstance(value, dict) and value:
            found += _leaves(value, (*prefix, key))
        else:
            found.append(((*prefix, key), value))
    return found


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(item) for item in value)
    return isinstance(value, dict) and any(_holds_tensor(item) for item in value.values())


def flat_stageable(state: dict[str, Any]) -> bool:
    """Whether `FlatStager` can stage `state`: string keys, and every tensor a plain CPU tensor held directly by
    a dict (no DTensor or other subclass, no device tensor, no tensor inside a list)."""
    for path, value in _leaves(state):
        if not all(isinstance(key, str) for key in path):
            return False
        if isinstance(value, torch.Tensor):
            if type(value) is not torch.Tensor or value.device.type != "cpu" or value.is_sparse:
                return False
        elif _holds_tensor(value):
            return False
    return True


class FlatStager(AsyncStager):
    """Stages a background save by one copy into shared-memory buffers kept for the run (see the module).

    Memory: one copy of this rank's checkpointed tensors (model and optimizer state), in shared memory, held
    from the first background save to the end of the run."""

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._signature: tuple | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        self._views: list[torch.Tensor] = []
        self._layout: list[tuple[Path, str, int, tuple[int, ...]]] = []

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        leaves = _leaves(state_dict)
        tensors = [(path, value) for path, value in leaves if isinstance(value, torch.Tensor)]
        signature = tuple((path, value.dtype, tuple(value.shape)) for path, value in tensors)
        if signature != self._signature:  # the first save, or a state of another shape: new buffers
            self._allocate(tensors)
            self._signature = signature
        # One call for every tensor: no per-tensor Python on the loop's path.
        torch._foreach_copy_(self._views, [value for _, value in tensors])
        values = [(path, value) for path, value in leaves if not isinstance(value, torch.Tensor)]
        return {FLAT_STATE_KEY: {"buffers": self._buffers, "layout": self._layout, "values": values}}

    def _allocate(self, tensors: list[tuple[Path, torch.Tensor]]) -> None:
        sizes: dict[torch.dtype, int] = {}
        placed = []
        for path, value in tensors:
            offset = sizes.get(value.dtype, 0)
            sizes[value.dtype] = offset + value.numel()
            placed.append((path, value.dtype, offset, tuple(value.shape)))
        self._buffers = {str(dtype): torch.empty(size, dtype=dtype).share_memory_() for dtype, size in sizes.items()}
        self._layout = [(path, str(dtype), offset, shape) for path, dtype, offset, shape in placed]
        self._views = [self._buffers[str(dtype)][offset:offset + _numel(shape)].view(shape)
                       for _, dtype, offset, shape in placed]

    @property
    def staged_bytes(self) -> int:
        """Bytes of shared memory the buffers hold."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self._buffers.values())

    def synchronize_staging(self) -> None:
        """The copy is synchronous: nothing to wait for."""

    def close(self) -> None:
        self._buffers, self._views, self._signature = {}, [], None


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
