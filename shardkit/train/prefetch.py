"""`DevicePrefetcher`: batches reach the device one batch ahead of use, and the resume state stays exact.

On CUDA the loader hands out pinned host tensors; the prefetcher draws batch k+1 and starts its copy on a
side stream as soon as batch k is handed to the step, so the copy overlaps step k instead of stalling the
start of step k+1 (a copy from pageable memory, or one on the compute stream, is synchronous with it).
Elsewhere (CPU) it converts each batch when asked: nothing to overlap, and the behaviour stays as before.

The batch drawn ahead is not yet used: a checkpoint saved now must not count it, or the resumed run would
skip it. So the prefetcher keeps the source's state from before that draw (torchdata's prefetcher keeps
one state per queued item for the same reason) and returns it from `state_dict`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch


class StatefulSource(Protocol):
    def __next__(self) -> Any: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class DevicePrefetcher:
    """Iterates `convert(raw batch)` over `source`, one batch ahead when `ahead`.

    Args:
        source: the host batches, with a resume state (`state_dict`/`load_state_dict`).
        convert: host batch -> batch on the device (e.g. `to_batch`); on CUDA it runs on a side stream.
        device: where the batches go.
        ahead: prefetch one batch (default: on CUDA only).
    """

    def __init__(self, source: StatefulSource, convert: Callable[[Any], Any], device: torch.device, *,
                 ahead: bool | None = None):
        self.source, self.convert, self.device = source, convert, device
        self.ahead = device.type == "cuda" if ahead is None else ahead
        self._stream = torch.cuda.Stream(device) if self.ahead and device.type == "cuda" else None
        self._next: Any = None
        self._state_before_next: dict[str, Any] | None = None

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self) -> Any:
        if not self.ahead:
            return self.convert(next(self.source))
        if self._next is None:
            self._fetch()
        batch, self._next = self._next, None
        if self._stream is not None:
            # The step's kernels run on the current stream: they wait for the copy, and the allocator
            # must not hand the copy's memory to the side stream again while they use it.
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self._stream)
            for tensor in _tensors(batch):
                tensor.record_stream(current)
        self._fetch()
        return batch

    def _fetch(self) -> None:
        self._state_before_next = self.source.state_dict()
        raw = next(self.source)
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            self._next = self.convert(raw)

    def state_dict(self) -> dict[str, Any]:
        """The source's state after the last batch handed out (the one drawn ahead not counted)."""
        return self._state_before_next if self._next is not None else self.source.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._next = self._state_before_next = None  # drawn under the old state: drop it
        self.source.load_state_dict(state)


def _tensors(batch: Any) -> list[torch.Tensor]:
    values = vars(batch).values() if hasattr(batch, "__dict__") else (
        batch.values() if isinstance(batch, dict) else [batch])
    return [value for value in values if isinstance(value, torch.Tensor)]
