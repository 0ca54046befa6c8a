"""The loader's side of built data (`BuiltSource.feed`, a built mixture's `MixtureSource.feed`): epochs of the global
order, handed out batch by batch.

The loader resolves the topology in the main process (after `init_process_group`), hands the start point to the
source (and so to the workers it spawns), and counts the batches it hands to the training loop: `state_dict()`
never includes batches that workers prefetched but the loop did not receive. Iterating again continues where the
last iteration stopped: the next epoch after a complete epoch, the rest of the same epoch after a `break`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from shardkit import metrics

from ...delivery.batch_counts import counted_batches
from ...delivery.closing import closed_at_exit
from ...order.quarantine import Quarantine
from ...order.rank_steps import IterationPlan
from ...source import Feed
from ...state.loader_state import LoaderState
from ...delivery.tensors import batch_to_tensors
from .token_batches import PROGRESS_KEY
from ...delivery.topology import Topology

logger = logging.getLogger(__name__)

_BUNDLE_BYTES = 2**20


def unbundle(items: Iterator[Any]) -> Iterator[dict]:
    for item in items:
        if isinstance(item, list):
            yield from item
        else:
            yield item


class BuiltFeed(Feed):
    """Epochs of an epoch engine (`source`: `engine.EpochEngine`), `batch_size` samples per rank per step."""

    def __init__(self, source: Any, batch_size: int | None):
        self.source = source
        self.samples_per_rank = source.batching.samples_per_rank(batch_size)
        self._epoch = 0
        # Positions of the epoch's global order handed to the training loop (and the token-budget window's
        # segments): the batch mode's step source owns them and their resume fields.
        self._steps = source.batching.step_source()
        self._topology: Topology | None = None
        self._quarantine = Quarantine(source.quarantine_sources())
        # Persistent workers continue with the next epoch by themselves only after a complete epoch.
        self._workers_in_sync = False

    def _resolve(self) -> Topology:
        self._topology = self.source.topology()  # also fixes the order's partitions
        return self._topology

    def length(self) -> int:
        # token-budget mode raises TypeError: the count depends on the lengths read
        return self._steps_left(self._resolve(), start=0, num_positions=self._positions(self._epoch))

    def _steps_left(self, topology: Topology, *, start: int, num_positions: int) -> int:
        return self.source.batching.steps_left(num_positions, start=start,
                                               global_batch=self.samples_per_rank * topology.world_size)

    def _positions(self, epoch: int) -> int:
        """Positions of `epoch`'s order without the quarantined shards."""
        return self.source.order(epoch, self.source.num_partitions, self._quarantine.entries).num_positions

    @property
    def epoch(self) -> int:
        return self._epoch

    def batches(self, loader: Any) -> Iterator[dict[str, torch.Tensor]]:
        source, topology = self.source, self._resolve()
        batching, global_batch = source.batching, self.samples_per_rank * topology.world_size
        source.mixture.pin(global_batch)
        num_positions = self._positions(self._epoch)
        if batching.finished(self._steps.consumed, num_positions, global_batch):
            self._epoch = self._epoch + 1  # resumed at an epoch's end
            self._steps.reset()
            num_positions = self._positions(self._epoch)
        self._quarantine.refuse_if_everything_left(num_positions)
        batching.check_fits(source.positions_per_epoch, batch_size=self.samples_per_rank,
                            world_size=topology.world_size)
        if self._steps.consumed == 0 and (summary := batching.epoch_summary(num_positions, global_batch=global_batch,
                                                                            world_size=topology.world_size)):
            logger.info("epoch %d: %s", self._epoch, summary)
        if not self._quarantine.checking:
            yield from self._read(loader, topology, steps=None)
        else:  # one checked segment at a time (see shardkit.loaders.order.quarantine)
            segment = max(1, source.config.chunk_samples // self.samples_per_rank)
            while True:
                iteration = self._iteration(topology, num_workers=loader.num_workers)
                self._quarantine.check(epoch=self._epoch, start=self._steps.consumed, steps=segment, plan=iteration)
                num_positions = self._positions(self._epoch)
                self._quarantine.refuse_if_everything_left(num_positions)
                if batching.finished(self._steps.consumed, num_positions, global_batch):
                    break
                yield from self._read(loader, topology, steps=segment)
        self._epoch = self._epoch + 1
        self._steps.reset()
        self._workers_in_sync = loader.persistent_workers and not self._quarantine.checking

    def _iteration(self, topology: Topology, *, num_workers: int, steps: int | None = None) -> IterationPlan:
        return IterationPlan(epoch=self._epoch, start=self._steps.consumed, batch_size=self.samples_per_rank,
                             topology=topology, num_partitions=self.source.num_partitions, numpy_batches=True,
                             bundle=self._bundle_size() if num_workers else 1,
                             segments=self._steps.segments, quarantine=self._quarantine.entries, steps=steps)

    @closed_at_exit  # its `finally` publishes counts: before the interpreter's teardown empties the modules
    def _read(self, loader: Any, topology: Topology, *, steps: int | None) -> Iterator[dict[str, torch.Tensor]]:
        """Hand out the batches of one reader run: the rest of the epoch, or `steps` steps of it."""
        if loader.has_worker_iterator() and not self._workers_in_sync:
            loader.stop_workers()
        if not loader.has_worker_iterator() or loader.num_workers == 0:
            self.source.begin(self._iteration(topology, num_workers=loader.num_workers, steps=steps))
        self._workers_in_sync = False
        # Without workers, read the dataset directly: the DataLoader machinery adds per-batch
        # overhead (profiler hooks, conversion) comparable to the cost of the batch itself.
        batches = iter(loader.dataset) if loader.num_workers == 0 else unbundle(loader.worker_batches())

        def prepare(arrays: dict[str, Any]) -> dict[str, torch.Tensor]:
            progress = arrays.pop(PROGRESS_KEY, None)
            workers = arrays.pop(metrics.WORKER_KEY, None)
            if workers is not None:
                metrics.merge_worker_counters(workers)
            self._steps.advance(len(arrays["sample_id"]), progress, topology.world_size)
            return batch_to_tensors(arrays, self.source.config.token_dtype)

        waiting_for = (f"reading the shards of epoch {self._epoch} at position {self._steps.consumed} into the node "
                       "cache (a cold cache downloads them)")
        yield from counted_batches(batches, prepare, waiting_for=waiting_for,
                                   pin=loader.pin_batches and torch.cuda.is_available())

    def _bundle_size(self) -> int:
        """Batches per worker message: about 1 MiB, at most 16 (per-message cost dominates small batches); each
        worker's first bundle goes as messages of 1, 1, 2, 4, ... (`partition.bundle_sizes`), so the first batch
        waits for one."""
        source = self.source
        if source.sample_length is None:
            return 4
        row = source.sample_length * (source.stored_token_dtype.itemsize + (4 if source.config.segment_ids else 0)) + 8
        return max(1, min(16, _BUNDLE_BYTES // (row * self.samples_per_rank)))

    def state_dict(self) -> dict[str, Any]:
        # The composition of the stages' states (the order and mixture, the step source, the quarantine).
        topology = self._topology or self._resolve()
        global_batch = self.samples_per_rank * topology.world_size
        self.source.mixture.pin(global_batch)
        return LoaderState(epoch=self._epoch, global_batch_size=global_batch, world_size=topology.world_size,
                           **self.source.state(), **self._steps.state(), **self._quarantine.state()).to_dict()

    def load_state_dict(self, state: dict[str, Any], *, allow_mixture_change: bool = False) -> None:
        saved = LoaderState.from_dict(state)
        self._quarantine.check_saved(saved)
        changed = self.source.restore(saved, allow_mixture_change=allow_mixture_change)
        # The saved position is checked against the epoch it was saved in: a mixture change may shorten
        # it, so then the saved epoch's length bounds it (quarantined positions only shorten an epoch).
        num_positions = (saved.epoch_size or saved.num_samples if changed else
                         self.source.order(saved.epoch, saved.num_partitions, saved.quarantine).num_positions)
        # The last step of an epoch may overrun its end (a padded step, a whole token window).
        if saved.samples_consumed > num_positions + self.source.batching.overrun(saved):
            raise ValueError(f"cannot resume: position.samples={saved.samples_consumed} is beyond the end of epoch "
                             f"{saved.epoch}, which holds {num_positions} positions (a damaged or edited state)")
        self._epoch = saved.epoch
        self._steps.restore(saved)
        self._quarantine.restore(saved)
        self._workers_in_sync = False
