"""A built dataset iterated without `StreamingDataLoader` (torch `DataLoader`, torchdata `StatefulDataLoader`).

Where the current epoch's iteration started (start, quarantine entries; None: the epoch's start) and the batches
this process (or this DataLoader worker) already yielded of it. Only a finished iteration advances the epoch. A
state taken here is a loader state (`shardkit.loaders.state.loader_state`) with this process's batches of the current epoch;
inside a DataLoader worker it is that worker's state (StatefulDataLoader saves one per worker).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from ...delivery.frameworks import NEEDS_BATCH_SIZE, refuse_read_ahead_without_length
from ...delivery.parent_watch import watch_parent
from ...order.rank_steps import IterationPlan
from ...delivery.resharding import check_not_resharded, check_not_rewrapped
from ...source import Standalone
from ...state.envelope import decode
from ...state.loader_state import LoaderState, check_worker_steps
from ...delivery.tensors import batch_to_tensors, strip_progress
from ...delivery.worker_copies import WorkerIterations


def this_worker() -> tuple[int, int]:
    """(this DataLoader worker, number of workers); (0, 1) outside workers."""
    info = get_worker_info()
    if info is None:
        return 0, 1
    watch_parent()  # a worker must not outlive its parent (shardkit.loaders.delivery.parent_watch)
    return info.id, info.num_workers


class BuiltStandalone(Standalone):
    """The standalone iteration of an epoch engine (`source`: `engine.EpochEngine`), `batch_size` samples per rank
    per step."""

    def __init__(self, source: Any, batch_size: int | None):
        self.source, self.batch_size = source, batch_size
        self.epoch = 0
        self._resume: tuple[int, tuple] | None = None
        self._steps_done = 0
        self._loaded_steps_batch: int | None = None  # the global batch of loaded worker steps (check_worker_steps)
        self.worker_iterations = WorkerIterations()  # refuses a state taken here while workers iterate copies

    def state_dict(self) -> dict[str, Any]:
        source = self.source
        check_not_rewrapped(source.claimed)
        self.worker_iterations.check_state_here()
        if self.batch_size is None:
            raise ValueError(f"StreamingDataset.state_dict() {NEEDS_BATCH_SIZE}")
        topology = source.topology()
        start, quarantine = self._start()
        global_batch = self.batch_size * topology.world_size
        source.mixture.pin(global_batch)
        worker, num_workers = this_worker()
        consumed, steps = start, self._steps_done
        if num_workers == 1:  # this process reads every step: the position is global
            consumed, steps = min(start + steps * global_batch,
                                  source.order(self.epoch, source.num_partitions, quarantine).num_positions), 0
        state = LoaderState(epoch=self.epoch, samples_consumed=consumed, global_batch_size=global_batch,
                            world_size=topology.world_size, **{**source.state(), "quarantine": quarantine})
        return state.to_dict(worker_steps=steps, worker=worker, num_workers=num_workers)

    def load_state_dict(self, state: dict[str, Any], *, allow_mixture_change: bool = False) -> None:
        saved = LoaderState.from_dict(state)
        state = decode(state)  # a worker's own fields
        steps = state.get("worker_steps", 0)
        if steps:
            _, num_workers = this_worker()
            if state.get("num_workers") != num_workers:
                raise ValueError(f"cannot resume: the state was saved by one of {state.get('num_workers')} "
                                 f"DataLoader workers; resume it with num_workers={state.get('num_workers')}")
        self.source.restore(saved, allow_mixture_change=allow_mixture_change)
        self.epoch, self._steps_done = saved.epoch, int(steps)
        self._loaded_steps_batch = saved.global_batch_size if steps else None
        self._resume = (saved.samples_consumed, saved.quarantine)

    def set_epoch(self, epoch: int) -> None:
        # The epoch the dataset already stands in keeps its position: a state just loaded (frameworks such as
        # accelerate call `set_epoch(current epoch)` on resume, after the load) or the rest of an iteration that
        # was broken off. Another epoch starts from its beginning.
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"set_epoch: epoch must be an integer >= 0, got {epoch!r}")
        if epoch == self.epoch:
            return
        self.epoch = int(epoch)
        self._steps_done, self._resume, self._loaded_steps_batch = 0, None, None

    def length(self) -> int:
        source = self.source
        topology = source.topology()
        try:
            steps = source.batching.steps_left(source.positions_per_epoch, start=0,
                                               global_batch=(self.batch_size or 1) * topology.world_size)
        except TypeError:  # token-budget mode: batches per epoch depend on the sample lengths
            refuse_read_ahead_without_length()
            raise
        if self.batch_size is None:
            raise TypeError("len(StreamingDataset) needs batch_size; use len(StreamingDataLoader)")
        return steps

    def _start(self) -> tuple[int, tuple]:
        """(position, quarantine entries) where the current standalone iteration starts."""
        return self._resume or (0, tuple((s, 0, 0) for s in self.source.listed_quarantine))

    def batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """One epoch (or its rest). A generator: creating it and throwing it away changes nothing; only reaching
        the end of the epoch advances it (`state_dict` counts the batches)."""
        source = self.source
        check_not_rewrapped(source.claimed)
        self.worker_iterations.note_iteration()
        batch_size = source.batching.standalone_batch_size(self.batch_size)
        topology = source.topology()
        check_not_resharded(topology.world_size)
        start, quarantine = self._start()
        source.mixture.pin(batch_size * topology.world_size)
        iteration = IterationPlan(epoch=self.epoch, start=start, batch_size=batch_size, topology=topology,
                                  num_partitions=source.num_partitions, quarantine=quarantine)
        source.batching.check_fits(source.positions_per_epoch, batch_size=batch_size, world_size=topology.world_size)
        check_worker_steps(self._loaded_steps_batch, batch_size * topology.world_size)
        order = source.order(self.epoch, source.num_partitions, quarantine)
        worker, num_workers = this_worker()
        for batch in source.batching.batches(source.reader, order, epoch=self.epoch, start=start,
                                             iteration=iteration, worker=worker, num_workers=num_workers,
                                             skip=self._steps_done):
            self._steps_done += 1  # before handing out: a state saved after receiving this batch includes it
            yield batch_to_tensors(strip_progress(batch), source.config.token_dtype)
        self.epoch, self._steps_done, self._resume, self._loaded_steps_batch = self.epoch + 1, 0, None, None
