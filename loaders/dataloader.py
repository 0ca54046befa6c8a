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
from abc import ABCMeta
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from shardkit import metrics

from .batch_counts import counted_batches
from .closing import closed_at_exit
from .dataset import StreamingDataset, raw_text_counterpart
from .rank_steps import IterationPlan
from .tensors import batch_to_tensors
from .token_batches import PROGRESS_KEY
from .quarantine import Quarantine
from .state import LoaderState
from .topology import Topology

logger = logging.getLogger(__name__)


_BUNDLE_BYTES = 2**20
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


class StreamingDataLoader(DataLoader, metaclass=ABCMeta):
    """DataLoader with `state_dict()` / `load_state_dict()` for a `StreamingDataset`.

    Args:
        dataset: the dataset.
        batch_size: samples per rank per step (the global batch is world_size x batch_size).
        num_workers: worker processes; each produces whole batches of alternate steps.
        pin_memory, timeout, multiprocessing_context, persistent_workers, prefetch_factor: as for
            `torch.utils.data.DataLoader`.
    """

    @classmethod
    def __subclasshook__(cls, candidate: type) -> bool:
        # What `StreamingDataLoader(raw_text_dataset)` returns (`RawTextDataLoader`) is one too (ABCMeta for this
        # check only: `type.__call__` still runs `__init__` for real subclasses alone).
        return raw_text_counterpart(cls, StreamingDataLoader, candidate, DataLoader)

    def __new__(cls, dataset: Any = None, *args: Any, **kwargs: Any):
        # A raw-text dataset has its own loader (`shardkit.loaders.raw_loader`): its state is the lanes' cursors.
        if cls is StreamingDataLoader and getattr(dataset, "raw_text", False):
            from .raw_loader import RawTextDataLoader

            return RawTextDataLoader(dataset, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, dataset: StreamingDataset, batch_size: int | None = None, num_workers: int = 0, *,
                 pin_memory: bool = False,
                 timeout: float = 0, multiprocessing_context: Any = None, persistent_workers: bool = False,
                 prefetch_factor: int | None = None):
        raw_text = getattr(dataset, "raw_text", False)
        if not isinstance(dataset, StreamingDataset) or raw_text:
            raise TypeError(f"{type(self).__name__} needs a StreamingDataset of built shards, got "
                            f"{type(dataset).__name__}" + ("; a raw-text dataset is read by StreamingDataLoader itself"
                                                          if raw_text else ""))
        # The one object the loader asks of the dataset (its order, mixture, batch mode, reader).
        self.plan = plan = dataset.plan
        self.samples_per_rank = plan.batching.samples_per_rank(batch_size)
        # Workers send numpy batches (pickled by value through the pipe: no shared-memory file
        # descriptor per tensor); the main process wraps them as tensors and pins them itself.
        super().__init__(dataset, batch_size=None, num_workers=num_workers, collate_fn=keep_batch, pin_memory=False,
                         timeout=timeout, multiprocessing_context=multiprocessing_context,
                         persistent_workers=persistent_workers, prefetch_factor=prefetch_factor)
        plan.claim()
        self.pin_batches = pin_memory
        self._epoch = 0
        # Positions of the epoch's global order handed to the training loop (and the token-budget window's
        # segments): the batch mode's step source owns them and their resume fields.
        self._steps = plan.batching.step_source()
        self._topology: Topology | None = None
        self._quarantine = Quarantine(plan.quarantine_sources())
        # Persistent workers continue with the next epoch by themselves only after a complete epoch.
        self._workers_in_sync = False

    # -- topology ------------------------------------------------------------------------------
    def _resolve(self) -> Topology:
        self._topology = self.plan.topology()  # also fixes the order's partitions
        return self._topology

    def __len__(self) -> int:
        """Batches per epoch for this rank (every rank gets the same number).

        Raises:
            TypeError: in token-budget mode, where the count depends on the lengths read.
        """
        return self._steps_left(self._resolve(), start=0, num_positions=self._positions(self._epoch))

    def _steps_left(self, topology: Topology, *, start: int, num_positions: int) -> int:
        return self.plan.batching.steps_left(num_positions, start=start,
                                             global_batch=self.samples_per_rank * topology.world_size)

    def _positions(self, epoch: int) -> int:
        """Positions of `epoch`'s order without the quarantined shards."""
        return self.plan.order(epoch, self.plan.num_partitions, self._quarantine.entries).num_positions

    @property
    def epoch(self) -> int:
        """The epoch the next iteration reads (advanced when an iteration reaches the end of its epoch)."""
        return self._epoch

    # -- iteration -----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        topology = self._resolve()
        batching, global_batch = self.plan.batching, self.samples_per_rank * topology.world_size
        self.plan.mixture.pin(global_batch)
        num_positions = self._positions(self._epoch)
        if batching.finished(self._steps.consumed, num_positions, global_batch):
            self._epoch = self._epoch + 1  # resumed at an epoch's end
            self._steps.reset()
            num_positions = self._positions(self._epoch)
        self._quarantine.refuse_if_everything_left(num_positions)
        batching.check_fits(self.plan.positions_per_epoch, batch_size=self.samples_per_rank,
                            world_size=topology.world_size)
        if self._steps.consumed == 0 and (summary := batching.epoch_summary(num_positions, global_batch=global_batch,
                                                                            world_size=topology.world_size)):
            logger.info("epoch %d: %s", self._epoch, summary)
        if not self._quarantine.checking:
            yield from self._read(topology, steps=None)
        else:  # one checked segment at a time (see shardkit.loaders.quarantine)
            segment = max(1, self.plan.config.chunk_samples // self.samples_per_rank)
            while True:
                iteration = self._iteration(topology)
                self._quarantine.check(epoch=self._epoch, start=self._steps.consumed, steps=segment, plan=iteration)
                num_positions = self._positions(self._epoch)
                self._quarantine.refuse_if_everything_left(num_positions)
                if batching.finished(self._steps.consumed, num_positions, global_batch):
                    break
                yield from self._read(topology, steps=segment)
        self._epoch = self._epoch + 1
        self._steps.reset()
        self._workers_in_sync = self.persistent_workers and not self._quarantine.checking

    def _iteration(self, topology: Topology, steps: int | None = None) -> IterationPlan:
        return IterationPlan(epoch=self._epoch, start=self._steps.consumed, batch_size=self.samples_per_rank,
                             topology=topology, num_partitions=self.plan.num_partitions, numpy_batches=True,
                             bundle=self._bundle_size() if self.num_workers else 1, segments=self._steps.segments,
                             quarantine=self._quarantine.entries, steps=steps)

    @closed_at_exit  # its `finally` publishes counts: before the interpreter's teardown empties the modules
    def _read(self, topology: Topology, *, steps: int | None) -> Iterator[dict[str, torch.Tensor]]:
        """Hand out the batches of one reader run: the rest of the epoch, or `steps` steps of it."""
        if self._iterator is not None and not self._workers_in_sync:
            self._iterator._shutdown_workers()
            self._iterator = None
        if self._iterator is None or self.num_workers == 0:
            self.plan.begin(self._iteration(topology, steps))
        self._workers_in_sync = False
        # Without workers, read the dataset directly: the DataLoader machinery adds per-batch
        # overhead (profiler hooks, conversion) comparable to the cost of the batch itself.
        source = iter(self.dataset) if self.num_workers == 0 else unbundle(super().__iter__())

        def prepare(arrays: dict[str, Any]) -> dict[str, torch.Tensor]:
            progress = arrays.pop(PROGRESS_KEY, None)
            workers = arrays.pop(metrics.WORKER_KEY, None)
            if workers is not None:
                metrics.merge_worker_counters(workers)
            self._steps.advance(len(arrays["sample_id"]), progress, topology.world_size)
            return batch_to_tensors(arrays, self.plan.config.token_dtype)

        yield from counted_batches(source, prepare, pin=self.pin_batches and torch.cuda.is_available())

    def _bundle_size(self) -> int:
        """Batches per worker message: about 1 MiB, at most 16 (per-message cost dominates small batches); each
        worker's first bundle goes as messages of 1, 1, 2, 4, ... (`partition.bundle_sizes`), so the first batch
        waits for one."""
        plan = self.plan
        if plan.sample_length is None:
            return 4
        row = plan.sample_length * (plan.stored_token_dtype.itemsize + (4 if plan.config.segment_ids else 0)) + 8
        return max(1, min(16, _BUNDLE_BYTES // (row * self.samples_per_rank)))

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The global resume state (identical on every rank; see `shardkit.loaders.state`): the composition of
        the stages' states (the order and mixture, the step source, the quarantine)."""
        topology = self._topology or self._resolve()
        global_batch = self.samples_per_rank * topology.world_size
        self.plan.mixture.pin(global_batch)
        return LoaderState(epoch=self._epoch, global_batch_size=global_batch, world_size=topology.world_size,
                           **self.plan.state(), **self._steps.state(), **self._quarantine.state()).to_dict()

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
        self._quarantine.check_saved(saved)
        changed = self.plan.restore(saved, allow_mixture_change=allow_mixture_change)
        # The saved position is checked against the epoch it was saved in: a mixture change may shorten
        # it, so then the saved epoch's length bounds it (quarantined positions only shorten an epoch).
        num_positions = (saved.epoch_size or saved.num_samples if changed else
                         self.plan.order(saved.epoch, saved.num_partitions, saved.quarantine).num_positions)
        # The last step of an epoch may overrun its end (a padded step, a whole token window).
        if saved.samples_consumed > num_positions + self.plan.batching.overrun(saved):
            raise ValueError(f"cannot resume: samples_consumed={saved.samples_consumed} is beyond the end of epoch "
                             f"{saved.epoch}, which holds {num_positions} positions (a damaged or edited state)")
        self._epoch = saved.epoch
        self._steps.restore(saved)
        self._quarantine.restore(saved)
        self._workers_in_sync = False
