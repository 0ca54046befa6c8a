"""`StreamingDataLoader`: a torch DataLoader over a `StreamingDataset` with exact, elastic resume, for every source.

The dataset's iterator already yields whole batches (or, in DataLoader workers, each worker's share of a step), so
the underlying DataLoader runs with `batch_size=None` and moves one batch per worker round trip. What differs
between sources (epochs of built data, endless lanes of raw text) is the source's `Feed`
(`shardkit.loaders.source`): this class holds it and asks it for the batches, the length and the state.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from shardkit import metrics

from .dataset import StreamingDataset
from .delivery.frameworks import holding_fetcher, refuse_untracked_fetcher
from .delivery.received import HeldBatches


def keep_batch(batch: Any) -> Any:
    """Collate function of the underlying DataLoader (runs in the worker): batches are already whole;
    the worker's metric increments travel with them to the parent."""
    return metrics.attach_worker_counters(batch)


class StreamingDataLoader(DataLoader):
    """DataLoader with `state_dict()` / `load_state_dict()` for a `StreamingDataset` (built data, raw text or a
    mixture of both).

    Args:
        dataset: the dataset.
        batch_size: samples per rank per step (the global batch is world_size x batch_size).
        num_workers: worker processes; built data: each produces whole batches of alternate steps; raw text: each
            tokenizes its share of the rank's lanes and the loading process assembles every step from their parts,
            so the batches do not depend on it.
        pin_memory, timeout, multiprocessing_context, persistent_workers, prefetch_factor: as for
            `torch.utils.data.DataLoader`.

    Raises:
        TypeError: `dataset` is not a `StreamingDataset`.
        ValueError: a bad option value, naming it.
    """

    def __init__(self, dataset: StreamingDataset, batch_size: int | None = None, num_workers: int = 0, *,
                 pin_memory: bool = False, timeout: float = 0, multiprocessing_context: Any = None,
                 persistent_workers: bool = False, prefetch_factor: int | None = None):
        if not isinstance(dataset, StreamingDataset):
            raise TypeError(f"{type(self).__name__} needs a StreamingDataset, got {type(dataset).__name__}")
        # The one object the loader asks of the dataset.
        self.source = source = dataset.source
        # Workers send numpy batches (pickled by value through the pipe: no shared-memory file
        # descriptor per tensor); the main process wraps them as tensors and pins them itself.
        super().__init__(dataset, batch_size=None, num_workers=num_workers, collate_fn=keep_batch, pin_memory=False,
                         timeout=timeout, multiprocessing_context=multiprocessing_context,
                         persistent_workers=persistent_workers, prefetch_factor=prefetch_factor)
        self.pin_batches = pin_memory
        self.feed = source.feed(self, batch_size)
        # The iteration a framework's fetcher holds batches of, read ahead of its training step (or None).
        self._held: HeldBatches | None = None
        source.claim()

    @property
    def samples_per_rank(self) -> int | None:
        """Samples per rank per step (None: token-budget batches, whose sizes follow the lengths)."""
        return self.feed.samples_per_rank

    def __len__(self) -> int:
        """Batches per epoch for this rank (every rank gets the same number).

        Raises:
            TypeError: where the source has no such number (token-budget batches; raw text, which is endless).
        """
        return self.feed.length()

    @property
    def epoch(self) -> int:
        """The epoch the next iteration reads (advanced when an iteration reaches the end of its epoch; always 0
        for raw text, which counts epochs per lane: each batch's `lane_epoch`)."""
        return self.feed.epoch

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        # The iteration holds the loader (`for batch in StreamingDataLoader(...)` keeps it alive); the feed does not.
        batches = self.feed.batches(self)
        fetcher = holding_fetcher()  # Lightning reading ahead (shardkit.loaders.delivery.received)
        self._held = None if fetcher is None else HeldBatches(
            fetcher, self.feed.local_state_dict, ahead=getattr(fetcher, "prefetch_batches", 1))
        return batches if self._held is None else self._held.follow(batches)

    # -- the DataLoader's workers, for the feeds -----------------------------------------------
    def worker_batches(self) -> Iterator[Any]:
        """What the DataLoader's worker processes yield (started, or continued when persistent)."""
        return DataLoader.__iter__(self)

    def has_worker_iterator(self) -> bool:
        """Whether persistent workers from an earlier iteration are still running."""
        return self._iterator is not None

    def stop_workers(self) -> None:
        """Shut the persistent workers down (the next iteration starts new ones where the loader stands)."""
        if self._iterator is not None:
            self._iterator._shutdown_workers()
            self._iterator = None

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The global resume state, identical on every rank (see `shardkit.loaders.state.loader_state`). Raw text gathers the
        lanes' cursors from every rank: with several ranks, every rank must call it.

        It counts the batches the training loop received: under a framework that reads ahead of its training step
        (Lightning without a length), not the batches it holds (`shardkit.loaders.delivery.received`)."""
        held = self._held_position()
        return self.feed.state_dict() if held is None else self.feed.global_state(held)

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's part of the state, without a collective (raw text: the cursors of the lanes this rank read;
        merge the ranks' with `shardkit.loaders.sources.raw.feed.merge_raw_states`). Built data: `state_dict()`."""
        held = self._held_position()
        return self.feed.local_state_dict() if held is None else held

    def _held_position(self) -> dict[str, Any] | None:
        """The local state before the batches a framework's fetcher holds back (None: it holds none)."""
        if self._held is None:
            refuse_untracked_fetcher(self)  # Lightning holding batches of an iteration not followed: refused
            return None
        return self._held.position()

    def load_state_dict(self, state: dict[str, Any], *, allow_mixture_change: bool = False) -> None:
        """Resume from `state_dict()` output, possibly saved with another world size, batch size or workers.

        Args:
            state: the saved state.
            allow_mixture_change: continue from the saved position with this dataset's streams and
                weights when they differ from the saved mixture (recorded in the state; see
                `shardkit.loaders.order.remix`). Off: such a state is refused.

        Raises:
            ValueError: the state is malformed or belongs to other data, settings or order (naming the field).
        """
        self.feed.load_state_dict(state, allow_mixture_change=allow_mixture_change)

    def counters(self) -> dict[str, int]:
        """What the loader counted so far (raw text: `skipped_units`, the unreadable units skipped)."""
        return self.feed.counters()
