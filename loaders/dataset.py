"""`StreamingDataset`: a torch IterableDataset that yields whole batches of this rank's share.

This module is the face. What the dataset reads is its `ReadPlan` (`shardkit.loaders.read_plan`): the
epoch's order, the mixture, the batch mode chosen once from the config, the reader, and where the next
iteration starts; the data loader talks to the plan only. Every decision about which sample goes where
is a pure function elsewhere (`effective_order`, `rank_steps`, `token_batches`). The iterator produces
*whole batches* so that, with DataLoader workers, one batch crosses the process boundary as a handful of
arrays instead of `batch_size` pickled samples.

The dataset is usually driven by `StreamingDataLoader`, which resolves the topology in the main
process, tells the dataset where to start (epoch, consumed positions) and counts what the training
loop received. Iterated on its own, it needs `batch_size` and starts each iteration at the next epoch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from .config import LoaderConfig, loader_config
from .frameworks import NEEDS_BATCH_SIZE
from .mixing import Stream
from .order import Order
from .parent_watch import watch_parent
from .rank_steps import IterationPlan
from .read_plan import ReadPlan
from .resharding import check_not_resharded, check_not_rewrapped
from .sources import Sources, streams_of
from .state import LoaderState, check_worker_steps
from .tensors import batch_to_tensors, bundled, strip_progress
from .token_batches import PROGRESS_KEY
from .topology import Topology, check_topology_args
from .worker_copies import WorkerIterations

logger = logging.getLogger(__name__)

# Re-exported: their callers import them from here (the loader, the trainer, integrations, benchmarks).
__all__ = ["PROGRESS_KEY", "IterationPlan", "StreamingDataset", "batch_to_tensors", "bundled", "strip_progress"]


def raw_text_counterpart(cls: type, kind: type, candidate: type, base: type) -> bool:
    """`__subclasshook__` of `kind` (asked as `cls`): True for a class marked `raw_text` built on `base`, the raw-text
    class that stands for `kind` (`RawTextDataset`, `RawTextDataLoader`); else Python's own check."""
    # The MRO, not issubclass(candidate, base): that asks the ABC hooks of base's subclasses, this one among them.
    if cls is kind and candidate.__dict__.get("raw_text") is True and base in candidate.__mro__:
        return True
    return NotImplemented


class StreamingDataset(IterableDataset):
    """Streams a shardkit dataset (or a mixture) to every rank, batch by batch.

    With `tokenizer=SPEC, seq_len=N` it reads raw text instead (JSONL / .gz / .zst, Parquet, .txt; files, globs
    or URLs), tokenized and packed on the fly: `shardkit.loaders.raw_dataset.RawTextDataset`.

    Args:
        source: dataset URL (any fsspec URL holding `shardkit.json`), a `Stream`, or a list of `Stream`.
        config: order, batching and cache options (`LoaderConfig`; default: its defaults).
        cache_dir: node-local cache directory shared by the node's processes
            (default `$SHARDKIT_CACHE_DIR` or a per-user temp directory).
        rank, world_size, local_rank, local_world_size: explicit topology (else resolved lazily).
        storage_options: fsspec options (e.g. S3 endpoint); never logged.
        process_group: data-parallel process group to take rank and world size from.
        device_mesh, mesh_dim: or a DeviceMesh and its data-parallel dimension.
        batch_size: samples per rank per step when iterated without `StreamingDataLoader`.
        **overrides: `LoaderConfig` fields (`shuffle=False`, `cache_limit=...`) applied over `config`.

    Raises:
        TypeError: `source` is not a URL or streams, or an override is not a `LoaderConfig` field.
        ValueError: a bad option value (naming it), or manifests that cannot be mixed.
    """

    @classmethod
    def __subclasshook__(cls, candidate: type) -> bool:
        # What `StreamingDataset(..., tokenizer=...)` returns (`RawTextDataset`) is one too, so that
        # `isinstance(dataset, StreamingDataset)` in integrations takes it. Not a subclass: it shares no code.
        return raw_text_counterpart(cls, StreamingDataset, candidate, IterableDataset)

    def __new__(cls, source: Any = None, *args: Any, **kwargs: Any):
        # Raw text (`tokenizer=` given) is read by its own dataset (`shardkit.loaders.raw_dataset`), or a
        # mixture of raw-text and built streams (`shardkit.loaders.raw_mixture`).
        if cls is StreamingDataset and kwargs.get("tokenizer") is not None:
            from .raw_mixture import raw_text_dataset

            return raw_text_dataset(source, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, source: str | Stream | Sequence[Stream], config: LoaderConfig | None = None, *,
                 cache_dir: str | None = None, rank: int | None = None, world_size: int | None = None,
                 local_rank: int | None = None, local_world_size: int | None = None,
                 storage_options: dict[str, Any] | None = None, process_group: Any = None, device_mesh: Any = None,
                 mesh_dim: Any = None, batch_size: int | None = None, **overrides: Any):
        super().__init__()
        self.config = config = loader_config(config, overrides, caller="StreamingDataset")
        self.streams = streams_of(source)
        topology_args = dict(rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size)
        check_topology_args(**topology_args)
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.sources = sources = Sources(self.streams, config, cache_dir=cache_dir, storage_options=storage_options)
        self.plan = plan = ReadPlan(config, self.streams, sources, topology_args=topology_args,
                                    group_args=dict(process_group=process_group, device_mesh=device_mesh,
                                                    mesh_dim=mesh_dim))
        # What users and integrations read of the data (the plan holds the same values).
        self.manifests, self.caches, self.table = sources.manifests, sources.caches, sources.table
        self.num_samples, self.sample_length = plan.num_samples, plan.sample_length
        self.stored_token_dtype = plan.stored_token_dtype  # as stored; `config.token_dtype` is what batches carry
        self.batch_size = batch_size
        # Standalone iteration (no StreamingDataLoader): where the current epoch's iteration started
        # (start, quarantine entries; None: the epoch's start) and the batches this process (or this DataLoader
        # worker) already yielded of it. Only a finished iteration advances the epoch.
        self._resume: tuple[int, tuple] | None = None
        self._steps_done = 0
        self._loaded_steps_batch: int | None = None  # the global batch of loaded worker steps (check_worker_steps)
        self.epoch = 0
        self.worker_iterations = WorkerIterations()  # refuses a state taken here while workers iterate copies

    # -- what users ask of the data ------------------------------------------------------------
    def resolve_topology(self) -> Topology:
        """Rank, world and node layout, resolved now (see `shardkit.loaders.topology`)."""
        return self.plan.topology()

    def order(self, epoch: int, num_partitions: int, quarantine: tuple[tuple[int, int, int], ...] = ()) -> Order:
        """The global order of `epoch` without the skipped samples and the positions of quarantined shards
        (`quarantine` entries, see `shardkit.loaders.quarantine`)."""
        return self.plan.order(epoch, num_partitions, quarantine)

    def skipped_ids(self) -> np.ndarray:
        """The sample ids `skip_samples` leaves out."""
        return self.plan.skipped_ids()

    def fingerprint(self) -> str:
        """Identity of the data (shard names, sizes and hashes, stream weights), not of its location."""
        return self.plan.fingerprint()

    def stream_fingerprints(self) -> list[str]:
        """Per stream, the fingerprint it has as a dataset of its own (a stream's identity in a mixture)."""
        return self.plan.stream_fingerprints()

    # -- standalone state (torch DataLoader, torchdata StatefulDataLoader) ---------------------
    def state_dict(self) -> dict[str, Any]:
        """Where a standalone iteration stands (torch `DataLoader`, torchdata `StatefulDataLoader`): a loader
        state (`shardkit.loaders.state`) with this process's batches of the current epoch. Inside a DataLoader
        worker it is that worker's state (StatefulDataLoader saves one per worker).

        Raises:
            ValueError: the dataset has no `batch_size` (it is driven by a `StreamingDataLoader`: save that).
        """
        plan = self.plan
        check_not_rewrapped(plan.claimed)
        self.worker_iterations.check_state_here()
        if self.batch_size is None:
            raise ValueError(f"StreamingDataset.state_dict() {NEEDS_BATCH_SIZE}")
        topology = plan.topology()
        start, quarantine = self._start()
        global_batch = self.batch_size * topology.world_size
        plan.mixture.pin(global_batch)
        worker, num_workers = _worker()
        consumed, steps = start, self._steps_done
        if num_workers == 1:  # this process reads every step: the position is global
            consumed, steps = min(start + steps * global_batch,
                                  plan.order(self.epoch, plan.num_partitions, quarantine).num_positions), 0
        state = LoaderState(epoch=self.epoch, samples_consumed=consumed, global_batch_size=global_batch,
                            world_size=topology.world_size, **{**plan.state(), "quarantine": quarantine})
        return {**state.to_dict(), "worker_steps": steps, "worker": worker, "num_workers": num_workers}

    def load_state_dict(self, state: dict[str, Any], *, allow_mixture_change: bool = False) -> None:
        """Start the next standalone iteration where `state` stands: this dataset's own `state_dict()` (also
        one DataLoader worker's) or a `StreamingDataLoader.state_dict()`; with `allow_mixture_change`, continue
        from the saved position with this dataset's streams and weights when they differ from the saved ones.

        Raises:
            ValueError: the state is malformed, belongs to another order, or is a worker's state loaded
                into another number of workers.
        """
        saved = LoaderState.from_dict(state)
        steps = state.get("worker_steps", 0)
        if steps:
            _, num_workers = _worker()
            if state.get("num_workers") != num_workers:
                raise ValueError(f"cannot resume: the state was saved by one of {state.get('num_workers')} "
                                 f"DataLoader workers; resume it with num_workers={state.get('num_workers')}")
        self.plan.restore(saved, allow_mixture_change=allow_mixture_change)
        self.epoch, self._steps_done = saved.epoch, int(steps)
        self._loaded_steps_batch = saved.global_batch_size if steps else None
        self._resume = (saved.samples_consumed, saved.quarantine)

    def set_epoch(self, epoch: int) -> None:
        """Epoch of the next standalone iteration (a `StreamingDataLoader` manages epochs itself).

        The epoch the dataset already stands in keeps its position: a state just loaded (frameworks such as
        accelerate call `set_epoch(current epoch)` on resume, after the load) or the rest of an iteration that
        was broken off. Another epoch starts from its beginning.

        Raises:
            ValueError: `epoch` is not an integer >= 0.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"set_epoch: epoch must be an integer >= 0, got {epoch!r}")
        if epoch == self.epoch:
            return
        self.epoch = int(epoch)
        self._steps_done, self._resume, self._loaded_steps_batch = 0, None, None

    def __len__(self) -> int:
        plan = self.plan
        topology = plan.topology()
        # token-budget mode raises TypeError here: batches per epoch depend on the sample lengths
        steps = plan.batching.steps_left(plan.positions_per_epoch, start=0,
                                         global_batch=(self.batch_size or 1) * topology.world_size)
        if self.batch_size is None:
            raise TypeError("len(StreamingDataset) needs batch_size; use len(StreamingDataLoader)")
        return steps

    # -- iteration -----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor] | dict[str, np.ndarray]]:
        plan = self.plan
        taken = plan.take_iteration()
        if taken is None:
            return self._standalone()
        iteration, offset = taken
        worker, num_workers = _worker()
        epoch, first = iteration.epoch + offset, offset == 0
        batches = plan.batching.batches(plan.reader, plan.order(epoch, iteration.num_partitions, iteration.quarantine),
                                        epoch=epoch, start=iteration.start if first else 0, iteration=iteration,
                                        worker=worker, num_workers=num_workers,
                                        segments=iteration.segments if first else (),
                                        limit=iteration.steps if first else None)
        if get_worker_info() is not None and iteration.bundle > 1:
            return bundled(batches, iteration.bundle)
        if iteration.numpy_batches:
            return batches
        return (batch_to_tensors(strip_progress(b), self.config.token_dtype) for b in batches)

    def _start(self) -> tuple[int, tuple]:
        """(position, quarantine entries) where the current standalone iteration starts."""
        return self._resume or (0, tuple((s, 0, 0) for s in self.plan.listed_quarantine))

    def _standalone(self) -> Iterator[dict[str, torch.Tensor]]:
        """One epoch (or its rest) without StreamingDataLoader. A generator: creating it and throwing it away
        changes nothing; only reaching the end of the epoch advances it (`state_dict` counts the batches)."""
        plan = self.plan
        check_not_rewrapped(plan.claimed)
        self.worker_iterations.note_iteration()
        batch_size = plan.batching.standalone_batch_size(self.batch_size)
        topology = plan.topology()
        check_not_resharded(topology.world_size)
        start, quarantine = self._start()
        plan.mixture.pin(batch_size * topology.world_size)
        iteration = IterationPlan(epoch=self.epoch, start=start, batch_size=batch_size, topology=topology,
                                  num_partitions=plan.num_partitions, quarantine=quarantine)
        plan.batching.check_fits(plan.positions_per_epoch, batch_size=batch_size, world_size=topology.world_size)
        check_worker_steps(self._loaded_steps_batch, batch_size * topology.world_size)
        order = plan.order(self.epoch, plan.num_partitions, quarantine)
        worker, num_workers = _worker()
        for batch in plan.batching.batches(plan.reader, order, epoch=self.epoch, start=start, iteration=iteration,
                                           worker=worker, num_workers=num_workers, skip=self._steps_done):
            self._steps_done += 1  # before handing out: a state saved after receiving this batch includes it
            yield batch_to_tensors(strip_progress(batch), self.config.token_dtype)
        self.epoch, self._steps_done, self._resume, self._loaded_steps_batch = self.epoch + 1, 0, None, None


def _worker() -> tuple[int, int]:
    """(this DataLoader worker, number of workers); (0, 1) outside workers."""
    info = get_worker_info()
    if info is None:
        return 0, 1
    watch_parent()  # a worker must not outlive its parent (shardkit.loaders.parent_watch)
    return info.id, info.num_workers
