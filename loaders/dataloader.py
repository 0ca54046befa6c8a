"""`StreamingDataLoader`: a torch DataLoader over a `StreamingDataset` with exact, elastic resume.

The dataset's iterator already yields whole batches, so the underlying DataLoader runs with
`batch_size=None` and moves one batch per worker round trip. This class resolves the topology in
the main process (after `init_process_group`), hands the start point to the dataset (and so to the
workers it spawns), and counts the batches it hands to the training loop: `state_dict()` never
includes batches that workers prefetched but the loop did not receive.

Iterating the loader again continues where the last iteration stopped: the next epoch after a
complete epoch, the rest of the same epoch after a `break`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from shardkit import metrics

from shardkit.loaders.closing import closed_at_exit
from shardkit.loaders.dataset import StreamingDataset
from shardkit.loaders.rank_steps import IterationPlan
from shardkit.loaders.tensors import batch_to_tensors
from shardkit.loaders.token_batches import PROGRESS_KEY
from shardkit.loaders.partition import dropped_in_epoch, partial_batch
from shardkit.loaders.quarantine import Quarantine
from shardkit.loaders.state import LoaderState
from shardkit.loaders.steps import step_source
from shardkit.loaders.topology import Topology

logger = logging.getLogger(__name__)


_BUNDLE_BYTES = 2**20
_PUBLISH_BATCHES = 64  # batch metrics are published every this many batches, or every second, or at the end
_PUBLISH_SECONDS = 1.0


class BatchCounts:
    """Batches handed out and the time waited for them, counted locally and published in groups
    (`shardkit_loader_batches_total` and `_wait_seconds_total` lag by at most 64 batches or a second)."""

    def __init__(self) -> None:
        self.batches, self.waited, self.published = 0, 0.0, time.perf_counter()

    def add(self, waited: float, now: float) -> None:
        self.batches += 1
        self.waited += waited
        if self.batches >= _PUBLISH_BATCHES or now - self.published >= _PUBLISH_SECONDS:
            self.publish(now)

    def publish(self, now: float) -> None:
        if self.batches:
            metrics.loader_batches(self.batches, self.waited)
        self.batches, self.waited, self.published = 0, 0.0, now


def unbundle(items: Iterator[Any]) -> Iterator[dict]:
    for item in items:
        if isinstance(item, list):
            yield from item
        else:
            yield item


def keep_batch(batch: Any) -> Any:
    """Collate function of the underlying DataLoader (runs in the worker): batches are already whole;
    the worker's metric increments travel with them to the parent."""
    return metrics.attach_worker_counters(batch)


class StreamingDataLoader(DataLoader):
    """DataLoader with `state_dict()` / `load_state_dict()` for a `StreamingDataset`.

    Args:
        dataset: the dataset.
        batch_size: samples per rank per step (the global batch is world_size x batch_size).
        num_workers: worker processes; each produces whole batches of alternate steps.
        pin_memory, timeout, multiprocessing_context, persistent_workers, prefetch_factor: as for
            `torch.utils.data.DataLoader`.
    """

    def __init__(self, dataset: StreamingDataset, batch_size: int | None = None, num_workers: int = 0, *,
                 pin_memory: bool = False,
                 timeout: float = 0, multiprocessing_context: Any = None, persistent_workers: bool = False,
                 prefetch_factor: int | None = None):
        if not isinstance(dataset, StreamingDataset):
            raise TypeError(f"StreamingDataLoader needs a StreamingDataset, got {type(dataset).__name__}")
        if dataset.config.max_tokens is not None:
            if batch_size is not None:
                raise ValueError("the dataset batches by max_tokens; pass batch_size=None")
        elif not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        # Workers send numpy batches (pickled by value through the pipe: no shared-memory file
        # descriptor per tensor); the main process wraps them as tensors and pins them itself.
        super().__init__(dataset, batch_size=None, num_workers=num_workers, collate_fn=keep_batch, pin_memory=False,
                         timeout=timeout, multiprocessing_context=multiprocessing_context,
                         persistent_workers=persistent_workers, prefetch_factor=prefetch_factor)
        dataset.claimed_by_loader = True
        self.pin_batches = pin_memory
        self.samples_per_rank = batch_size or 1
        self.token_mode = dataset.config.max_tokens is not None
        self._epoch = 0
        # Positions of the epoch's global order handed to the training loop (and the token-budget window's
        # segments): the step source owns them and their resume fields.
        self._steps = step_source(dataset.config.max_tokens, dataset.config.token_window)
        self._num_partitions: int | None = dataset.config.num_partitions
        self._topology: Topology | None = None
        self._quarantine = Quarantine(dataset.quarantine_sources())
        # Persistent workers continue with the next epoch by themselves only after a complete epoch.
        self._workers_in_sync = False

    # -- topology ------------------------------------------------------------------------------
    def _resolve(self) -> Topology:
        topology = self.dataset.resolve_topology()
        if self._num_partitions is None:
            self._num_partitions = self.dataset.resolve_partitions(topology)
        self._topology = topology
        return topology

    def __len__(self) -> int:
        """Batches per epoch for this rank (every rank gets the same number).

        Raises:
            TypeError: in token-budget mode, where the count depends on the lengths read.
        """
        if self.token_mode:
            raise TypeError("len() is unknown in token-budget mode: batches depend on the sample lengths")
        topology = self._resolve()
        return self.dataset.batches_per_epoch(self.samples_per_rank, topology, num_positions=self._positions(self._epoch))

    def _positions(self, epoch: int) -> int:
        """Positions of `epoch`'s order without the quarantined shards."""
        return self.dataset.order(epoch, self._num_partitions, self._quarantine.entries).num_positions

    @property
    def epoch(self) -> int:
        """The epoch the next iteration reads (advanced when an iteration reaches the end of its epoch)."""
        return self._epoch

    # -- iteration -----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        topology = self._resolve()
        self.dataset.pin_global_batch(self.samples_per_rank * topology.world_size)
        num_positions = self._positions(self._epoch)
        finished = (self._steps.consumed >= num_positions if self.token_mode else
                    self.dataset.batches_per_epoch(self.samples_per_rank, topology, start=self._steps.consumed,
                                                   num_positions=num_positions) == 0)
        if finished:
            self._epoch = self._epoch + 1  # resumed at an epoch's end
            self._steps.reset()
            num_positions = self._positions(self._epoch)
        self._quarantine.refuse_if_everything_left(num_positions)
        if not self.token_mode:
            self.dataset.check_batch_fits(self.samples_per_rank, topology)
        if self._steps.consumed == 0 and not self.token_mode:
            self._log_epoch(num_positions, topology)
        if not self._quarantine.checking:
            yield from self._read(topology, steps=None)
        else:  # one checked segment at a time (see shardkit.loaders.quarantine)
            segment = max(1, self.dataset.config.chunk_samples // self.samples_per_rank)
            while True:
                plan = self._plan(topology)
                self._quarantine.check(epoch=self._epoch, start=self._steps.consumed, steps=segment, plan=plan)
                self._quarantine.refuse_if_everything_left(self._positions(self._epoch))
                if self.dataset.batches_per_epoch(self.samples_per_rank, topology, start=self._steps.consumed,
                                                  num_positions=self._positions(self._epoch)) == 0:
                    break
                yield from self._read(topology, steps=segment)
        self._epoch = self._epoch + 1
        self._steps.reset()
        self._workers_in_sync = self.persistent_workers and not self._quarantine.checking

    def _plan(self, topology: Topology, steps: int | None = None) -> IterationPlan:
        return IterationPlan(epoch=self._epoch, start=self._steps.consumed, batch_size=self.samples_per_rank,
                             topology=topology, num_partitions=self._num_partitions, numpy_batches=True,
                             bundle=self._bundle_size() if self.num_workers else 1, segments=self._steps.segments,
                             quarantine=self._quarantine.entries, steps=steps)

    def _log_epoch(self, num_positions: int, topology: Topology) -> None:
        global_batch = self.samples_per_rank * topology.world_size
        policy = self.dataset.config.partial_batches
        left = dropped_in_epoch(num_positions, global_batch=global_batch, policy=policy,
                                world_size=topology.world_size)
        last = partial_batch(num_positions, start=0, global_batch=global_batch, world_size=topology.world_size,
                             policy=policy)
        logger.info("epoch %d: %d batches per rank, global batch %d, %s %d positions (partial_batches=%s%s)",
                    self._epoch, len(self), global_batch, "drops" if left >= 0 else "pads", abs(left), policy,
                    f": last batch {last} samples per rank" if last is not None else "")

    @closed_at_exit  # its `finally` publishes counts: before the interpreter's teardown empties the modules
    def _read(self, topology: Topology, *, steps: int | None) -> Iterator[dict[str, torch.Tensor]]:
        """Hand out the batches of one reader run: the rest of the epoch, or `steps` steps of it."""
        if self._iterator is not None and not self._workers_in_sync:
            self._iterator._shutdown_workers()
            self._iterator = None
        if self._iterator is None or self.num_workers == 0:
            self.dataset.set_plan(self._plan(topology, steps))
        self._workers_in_sync = False
        # Without workers, read the dataset directly: the DataLoader machinery adds per-batch
        # overhead (profiler hooks, conversion) comparable to the cost of the batch itself.
        source = iter(self.dataset) if self.num_workers == 0 else unbundle(super().__iter__())
        pin = self.pin_batches and torch.cuda.is_available()
        asked = time.perf_counter()
        counts = BatchCounts()
        try:
            for arrays in source:
                progress = arrays.pop(PROGRESS_KEY, None)
                workers = arrays.pop(metrics.WORKER_KEY, None)
                if workers is not None:
                    metrics.merge_worker_counters(workers)
                batch = batch_to_tensors(arrays, self.dataset.config.token_dtype)
                if pin:
                    batch = {k: v.pin_memory() for k, v in batch.items()}
                # Count before handing out: a state saved after receiving this batch includes it.
                self._steps.advance(len(arrays["sample_id"]), progress, topology.world_size)
                now = time.perf_counter()
                counts.add(now - asked, now)
                yield batch
                asked = time.perf_counter()
        finally:
            counts.publish(time.perf_counter())

    def _bundle_size(self) -> int:
        """Batches per worker message: about 1 MiB, at most 16 (per-message cost dominates small batches)."""
        ds = self.dataset
        if ds.sample_length is None:
            return 4
        row = ds.sample_length * (ds.token_dtype.itemsize + (4 if ds.config.segment_ids else 0)) + 8
        return max(1, min(16, _BUNDLE_BYTES // (row * self.samples_per_rank)))

    # -- state ---------------------------------------------------------------------------------
    def _current_state(self, num_partitions: int | None = None) -> LoaderState:
        topology = self._topology or self._resolve()
        ds = self.dataset
        ds.pin_global_batch(self.samples_per_rank * topology.world_size)
        record = ds.mixture_record()
        order = {**ds.config.order_values(), "num_partitions": num_partitions or self._num_partitions}
        return LoaderState(epoch=self._epoch, **self._steps.get_state(), dataset=ds.fingerprint(),
                           num_samples=ds.num_samples, global_batch_size=self.samples_per_rank * topology.world_size,
                           world_size=topology.world_size,
                           mixture=record.to_dict() if record is not None else None,
                           quarantine=self._quarantine.state(), **order)

    def state_dict(self) -> dict[str, Any]:
        """The global resume state (identical on every rank; see `shardkit.loaders.state`)."""
        return self._current_state().to_dict()

    def load_state_dict(self, state: dict[str, Any], *, allow_mixture_change: bool = False) -> None:
        """Resume from `state_dict()` output, possibly saved with another world size or batch size.

        Args:
            state: the saved state.
            allow_mixture_change: continue from the saved position with this dataset's streams and
                weights when they differ from the saved mixture (recorded in the state; see
                `shardkit.loaders.remix`). Off: such a state is refused.

        Raises:
            ValueError: the state is malformed or its order differs (dataset, seed, partitions...).
        """
        saved = LoaderState.from_dict(state)
        shards = len(self.dataset.table.ends)
        bad = [entry for entry in saved.quarantine if not 0 <= entry[0] < shards]
        if bad:
            raise ValueError(f"cannot resume: the state quarantines shard {bad[0][0]}, but the dataset has {shards}")
        changed = self.dataset.resume_from(saved, allow_mixture_change=allow_mixture_change)
        # The saved position is checked against the epoch it was saved in: a mixture change may shorten
        # it, so then the saved epoch's length bounds it (quarantined positions only shorten an epoch).
        num_positions = (saved.epoch_size or saved.num_samples if changed else
                         self.dataset.order(saved.epoch, saved.num_partitions, saved.quarantine).num_positions)
        # The last step of an epoch may overrun its end: padded (pad, partial) or a whole token window (token budget).
        overrun = (saved.token_window if saved.max_tokens is not None else
                   saved.global_batch_size if saved.partial_batches in ("pad", "partial") else 0)
        if saved.samples_consumed > num_positions + overrun:
            raise ValueError(f"cannot resume: samples_consumed={saved.samples_consumed} is beyond the end of epoch "
                             f"{saved.epoch}, which holds {num_positions} positions (a damaged or edited state)")
        self._num_partitions = saved.num_partitions
        self._epoch = saved.epoch
        self._steps.from_state(saved)
        self._quarantine.restore(saved.quarantine, epoch=saved.epoch, consumed=saved.samples_consumed,
                                 num_partitions=saved.num_partitions)
        self._workers_in_sync = False
