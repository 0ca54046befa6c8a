"""`StreamingDataset`: a torch IterableDataset that yields whole batches of this rank's share.

This module is wiring. Every decision about which sample goes where is a pure function elsewhere
(`effective_order`: an epoch's order after skip_samples and quarantine; `rank_steps`: this rank's sample
ids step by step; `token_batches`: token-budget steps); the streams, manifests and caches are
`sources.Sources`; reading is the `reading.BatchReader`'s. The iterator produces *whole batches* so that,
with DataLoader workers, one batch crosses the process boundary as a handful of arrays instead of
`batch_size` pickled samples.

The dataset is usually driven by `StreamingDataLoader`, which resolves the topology in the main
process, tells the dataset where to start (epoch, consumed positions) and counts what the training
loop received. Iterated on its own, it needs `batch_size` and starts each iteration at the next epoch.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from shardkit.loaders.config import LoaderConfig, loader_config
from shardkit.loaders.effective_order import effective_order
from shardkit.loaders.fingerprint import data_fingerprint
from shardkit.loaders.frameworks import NEEDS_BATCH_SIZE, check_framework
from shardkit.loaders.mixing import Stream
from shardkit.loaders.order import Order, OrderConfig
from shardkit.loaders.partition import steps_in_epoch
from shardkit.loaders.quarantine import QuarantineSources, resolve_quarantine_list
from shardkit.loaders.rank_steps import IterationPlan, rank_step_ids
from shardkit.loaders.reading import BatchReader
from shardkit.loaders.remix import MixtureRecord, MixtureStreams, fresh_record, resumed_record
from shardkit.loaders.resharding import check_not_resharded, check_not_rewrapped
from shardkit.loaders.schedule import weight_spec
from shardkit.loaders.skipping import resolve_skipped
from shardkit.loaders.sources import Sources, streams_of
from shardkit.loaders.state import MIXTURE_FIELDS, LoaderState, check_worker_steps
from shardkit.loaders.tensors import batch_to_tensors, bundled, strip_progress
from shardkit.loaders.token_batches import PROGRESS_KEY, token_batches
from shardkit.loaders.topology import Topology, check_topology_args, resolve_topology
from shardkit.loaders.worker_copies import WorkerIterations

logger = logging.getLogger(__name__)

# Re-exported: their callers import them from here (the loader, the trainer, integrations, benchmarks).
__all__ = ["PROGRESS_KEY", "IterationPlan", "StreamingDataset", "batch_to_tensors", "bundled", "strip_progress"]
_MEMO_ORDERS = 4  # an epoch's order with quarantine scans the epoch once: keep the last few


class StreamingDataset(IterableDataset):
    """Streams a shardkit dataset (or a mixture) to every rank, batch by batch.

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

    def __init__(self, source: str | Stream | Sequence[Stream], config: LoaderConfig | None = None, *,
                 cache_dir: str | None = None, rank: int | None = None, world_size: int | None = None,
                 local_rank: int | None = None, local_world_size: int | None = None,
                 storage_options: dict[str, Any] | None = None, process_group: Any = None, device_mesh: Any = None,
                 mesh_dim: Any = None, batch_size: int | None = None, **overrides: Any):
        super().__init__()
        self.config = config = loader_config(config, overrides, caller="StreamingDataset")
        self.streams = streams_of(source)
        self._topology_args = dict(rank=rank, world_size=world_size, local_rank=local_rank,
                                   local_world_size=local_world_size)
        check_topology_args(**self._topology_args)
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.sources = sources = Sources(self.streams, config, cache_dir=cache_dir, storage_options=storage_options)
        self.manifests, self.caches, self.table = sources.manifests, sources.caches, sources.table
        batch_format = sources.batch_format()
        self.sample_length, self.token_dtype = batch_format["sample_length"], batch_format["token_dtype"]
        self.num_samples = sum(m.num_samples for m in self.manifests)
        self.reader = BatchReader(table=self.table, caches=self.caches, shard_owner=sources.owners,
                                  manifests=self.manifests, dense_segments=config.segment_ids,
                                  prefetch=config.prefetch, **batch_format)
        self.batch_size = batch_size
        self._group_args = dict(process_group=process_group, device_mesh=device_mesh, mesh_dim=mesh_dim)
        self.listed_quarantine = (resolve_quarantine_list(config.quarantine_list, self.manifests,
                                                          [s.url for s in self.streams])
                                  if config.quarantine_list is not None else ())
        self._skipped: np.ndarray | None = None  # skip_samples resolved to sample ids (on first use)
        self._orders: dict[tuple, Order] = {}
        self._plan: IterationPlan | None = None
        self._fingerprints: dict[str | int, str] = {}  # see fingerprint(): computed once, O(shards) each
        self._mixture: MixtureRecord | None = None  # see mixture_record()
        # Standalone iteration (no StreamingDataLoader): where the current epoch's iteration started
        # (start, num_partitions, quarantine entries; None: the epoch's start) and the batches this process
        # (or this DataLoader worker) already yielded of it. Only a finished iteration advances the epoch.
        self._resume: tuple[int, int, tuple] | None = None
        self._steps_done = 0
        self._loaded_steps_batch: int | None = None  # the global batch of loaded worker steps (check_worker_steps)
        self._iterations = 0
        self.epoch = 0
        # Set by the StreamingDataLoader that drives this dataset: another loader iterating it on its own (what
        # accelerator.prepare() builds around a prepared loader's dataset) would bypass the loader's batching and
        # state, so standalone iteration is refused then.
        self.claimed_by_loader = False
        self.worker_iterations = WorkerIterations()  # refuses a state taken here while workers iterate copies

    def __getstate__(self) -> dict:
        # Process groups and meshes do not pickle; workers get the topology through the plan.
        state = self.__dict__.copy()
        state["_group_args"] = dict.fromkeys(self._group_args)
        return state

    # -- configuration -------------------------------------------------------------------------
    def resolve_topology(self) -> Topology:
        """Rank, world and node layout, resolved now (see `shardkit.loaders.topology`).

        Raises:
            ValueError: a training framework among the callers runs the dataset the wrong way (`frameworks`).
        """
        topology = resolve_topology(**self._topology_args, **self._group_args)
        check_framework(topology.world_size, standalone=not self.claimed_by_loader)
        return topology

    def resolve_partitions(self, topology: Topology) -> int:
        """Partitions of the global order: `num_partitions` when set, else one per node of `topology` (fixed by the
        first run and kept on resume, so an elastic resume continues the same order)."""
        return self.config.num_partitions if self.config.num_partitions is not None else topology.num_nodes

    def order_config(self, num_partitions: int) -> OrderConfig:
        """The pure order's parameters (seed, shuffle, block size, window) with `num_partitions` resolved."""
        return self.config.order_config(num_partitions)

    def order(self, epoch: int, num_partitions: int, quarantine: tuple[tuple[int, int, int], ...] = ()) -> Order:
        """The global order of `epoch` (pure function of manifests, seed, epoch and partitions), without the
        skipped samples and the positions of quarantined shards (`quarantine` entries, see
        `shardkit.loaders.quarantine`)."""
        key = (epoch, num_partitions, tuple(quarantine))
        if key in self._orders:
            return self._orders[key]
        record = self.mixture_record()
        order = effective_order(self.sources.shard_sizes, self.order_config(num_partitions), epoch,
                                mixture=record.plan if record is not None else None,
                                skipped=self.skipped_ids() if self.config.skip_samples and record is None else None,
                                quarantine=quarantine)
        if quarantine:  # quarantine scans the epoch's order once: keep the last few
            if len(self._orders) >= _MEMO_ORDERS:
                self._orders.pop(next(iter(self._orders)))
            self._orders[key] = order
        return order

    def quarantine_sources(self) -> QuarantineSources:
        """The functions and values the loader's quarantine works with (it is never handed the dataset)."""
        return QuarantineSources(order=self.order, rank_shards=self.rank_shards, shard_ends=self.table.ends,
                                 shard_sizes=self.table.sizes, describe=self.sources.describe_shard,
                                 verify=self.sources.verify_shard, agreement_group=self.agreement_group,
                                 listed=self.listed_quarantine, listed_path=self.config.quarantine_list,
                                 checking=self.config.on_corrupt == "skip")

    def shard_owner(self, index: int) -> tuple[int, int]:
        """(stream, shard within the stream) of shard `index` over all streams."""
        return self.sources.owners[index]

    def agreement_group(self) -> Any:
        """The data-parallel process group (None: the default group)."""
        mesh, dim = self._group_args["device_mesh"], self._group_args["mesh_dim"]
        if mesh is not None:
            return mesh.get_group(dim) if dim is not None else mesh.get_group()
        return self._group_args["process_group"]

    def fingerprint(self) -> str:
        """Identity of the data (shard names, sizes and hashes, stream weights), not of its location."""
        if "all" not in self._fingerprints:
            weights = [weight_spec(s.weight) for s in self.streams] if len(self.streams) > 1 else []
            self._fingerprints["all"] = data_fingerprint(self.manifests, weights)
        return self._fingerprints["all"]

    def stream_fingerprints(self) -> list[str]:
        """Per stream, the fingerprint it has as a dataset of its own (a stream's identity in a mixture)."""
        if len(self.manifests) == 1:
            return [self.fingerprint()]  # one stream: no weights, the same value
        for i, manifest in enumerate(self.manifests):
            if i not in self._fingerprints:
                self._fingerprints[i] = data_fingerprint([manifest], [])
        return [self._fingerprints[i] for i in range(len(self.manifests))]

    # -- mixture plan and its changes (shardkit.loaders.remix) ------------------------------------
    def _mixture_streams(self) -> MixtureStreams:
        return MixtureStreams(urls=[s.url for s in self.streams], fingerprints=self.stream_fingerprints(),
                              weights=[s.weight for s in self.streams], epoch_size=self.positions_per_epoch,
                              policy=self.config.partial_batches)

    def mixture_record(self) -> MixtureRecord | None:
        """The mixture's record (None for a single dataset that never changed its mixture)."""
        if self._mixture is None and len(self.streams) > 1:
            self._mixture = fresh_record(self._mixture_streams())
        return self._mixture

    def pin_global_batch(self, global_batch: int) -> None:
        """Fix the positions per step of weight schedules: the first run's global batch, kept on resume."""
        record = self.mixture_record()
        if record is not None:
            self._mixture = record.pinned(global_batch)

    def resume_from(self, saved: LoaderState, *, allow_mixture_change: bool = False) -> bool:
        """Check that `saved` continues this dataset's order and adopt its mixture record; with
        `allow_mixture_change`, continue from the saved position with this dataset's streams and weights.
        True when the mixture changed.

        Raises:
            ValueError: the order differs (every difference named), or only the mixture does and
                `allow_mixture_change` is off, or the change cannot be made exactly.
        """
        explicit = self.config.num_partitions
        values = {**self.config.order_values(), "dataset": self.fingerprint(), "num_samples": self.num_samples,
                  "num_partitions": explicit if explicit is not None else saved.num_partitions}
        current = dataclasses.replace(saved, **values)
        differences, fixed = saved.differences(current), saved.differences(current, ignore=MIXTURE_FIELDS)
        if fixed or (differences and not allow_mixture_change):
            hint = ("" if fixed else "; to continue with the new mixture from the saved position, pass "
                    "allow_mixture_change=True (shardkit train: --allow-mixture-change)")
            raise ValueError("cannot resume: the saved loader state belongs to another order ("
                             + "; ".join(differences) + ")" + hint)
        self._mixture = resumed_record(saved, self._mixture_streams(), changed=bool(differences))
        if differences:
            change = self._mixture.changes[-1]
            logger.info("mixture changed at step %d (epoch %d, position %d): %s -> %s", change["step"], saved.epoch,
                        saved.samples_consumed, change["old"], change["new"])
        return bool(differences)

    def state_dict(self) -> dict[str, Any]:
        """Where a standalone iteration stands (torch `DataLoader`, torchdata `StatefulDataLoader`): a loader
        state (`shardkit.loaders.state`) with this process's batches of the current epoch. Inside a DataLoader
        worker it is that worker's state (StatefulDataLoader saves one per worker).

        Raises:
            ValueError: the dataset has no `batch_size` (it is driven by a `StreamingDataLoader`: save that).
        """
        check_not_rewrapped(self.claimed_by_loader)
        self.worker_iterations.check_state_here()
        if self.batch_size is None:
            raise ValueError(f"StreamingDataset.state_dict() {NEEDS_BATCH_SIZE}")
        topology = self.resolve_topology()
        start, partitions, quarantine = self._resume or (0, self.resolve_partitions(topology),
                                                         tuple((s, 0, 0) for s in self.listed_quarantine))
        self.pin_global_batch(self.batch_size * topology.world_size)
        record = self.mixture_record()
        worker, num_workers = _worker()
        consumed, steps = start, self._steps_done
        if num_workers == 1:  # this process reads every step: the position is global
            consumed, steps = min(start + steps * self.batch_size * topology.world_size,
                                  self.order(self.epoch, partitions, quarantine).num_positions), 0
        state = LoaderState(epoch=self.epoch, samples_consumed=consumed, dataset=self.fingerprint(),
                            num_samples=self.num_samples, global_batch_size=self.batch_size * topology.world_size,
                            world_size=topology.world_size, mixture=record.to_dict() if record is not None else None,
                            quarantine=quarantine, **{**self.config.order_values(), "num_partitions": partitions})
        return {**state.to_dict(), "worker_steps": steps, "worker": worker, "num_workers": num_workers}

    def load_state_dict(self, state: dict[str, Any], *, allow_mixture_change: bool = False) -> None:
        """Start the next standalone iteration where `state` stands: this dataset's own `state_dict()` (also
        one DataLoader worker's) or a `StreamingDataLoader.state_dict()` (the loader calls `resume_from`
        itself); see `resume_from` for `allow_mixture_change`.

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
        self.resume_from(saved, allow_mixture_change=allow_mixture_change)
        self.epoch, self._steps_done = saved.epoch, int(steps)
        self._loaded_steps_batch = saved.global_batch_size if steps else None
        self._resume = (saved.samples_consumed, saved.num_partitions, saved.quarantine)

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
        self._iterations = 0
        self._steps_done, self._resume, self._loaded_steps_batch = 0, None, None

    def set_plan(self, plan: IterationPlan) -> None:
        """Where the next iteration starts; later iterations (persistent workers) take later epochs."""
        self._plan = plan
        self._iterations = 0

    def skipped_ids(self) -> np.ndarray:
        """The sample ids `skip_samples` leaves out (resolved once, in the process that first asks: the
        loader's main process, before workers start, so documents are looked up only there)."""
        if self._skipped is None:
            self._skipped = resolve_skipped(self.config.skip_samples, self.manifests[0], self.caches[0])
        return self._skipped

    @property
    def positions_per_epoch(self) -> int:
        """Samples in one epoch's order (a mixture's epoch_size, else all samples not skipped)."""
        if len(self.streams) == 1:
            return self.num_samples - (len(self.skipped_ids()) if self.config.skip_samples else 0)
        return self.config.epoch_size or self.num_samples

    def batches_per_epoch(self, batch_size: int, topology: Topology, start: int = 0,
                          num_positions: int | None = None) -> int:
        """Steps left from `start` in an epoch of `num_positions` (default: `positions_per_epoch`)."""
        return steps_in_epoch(self.positions_per_epoch if num_positions is None else num_positions, start=start,
                              global_batch=batch_size * topology.world_size, policy=self.config.partial_batches)

    def check_batch_fits(self, batch_size: int, topology: Topology) -> None:
        """Raise when an epoch holds no whole global batch (iteration would silently yield nothing).

        Raises:
            ValueError: naming batch_size, the world size and the samples per epoch.
        """
        if self.batches_per_epoch(batch_size, topology) == 0:
            raise ValueError(f"batch_size={batch_size} x world_size={topology.world_size} is larger than the "
                             f"{self.positions_per_epoch} samples of an epoch: no batch would be yielded with "
                             f"partial_batches={self.config.partial_batches!r}; lower batch_size or use partial_batches='pad'")

    def __len__(self) -> int:
        if self.config.max_tokens is not None:
            raise TypeError("token-budget batches per epoch depend on the sample lengths: unknown before reading")
        if self.batch_size is None:
            raise TypeError("len(StreamingDataset) needs batch_size; use len(StreamingDataLoader)")
        return self.batches_per_epoch(self.batch_size, self.resolve_topology())

    # -- iteration -----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor] | dict[str, np.ndarray]]:
        if self._plan is None:
            return self._standalone()
        plan = self._plan
        offset, self._iterations = self._iterations, self._iterations + 1
        worker, num_workers = _worker()
        batches = self._batches(plan.epoch + offset, plan.start if offset == 0 else 0, plan, worker, num_workers,
                                segments=plan.segments if offset == 0 else (),
                                limit=plan.steps if offset == 0 else None)
        if get_worker_info() is not None and plan.bundle > 1:
            return bundled(batches, plan.bundle)
        if plan.numpy_batches:
            return batches
        return (batch_to_tensors(strip_progress(b), self.config.token_dtype) for b in batches)

    def _standalone(self) -> Iterator[dict[str, torch.Tensor]]:
        """One epoch (or its rest) without StreamingDataLoader. A generator: creating it and throwing it away
        changes nothing; only reaching the end of the epoch advances it (`state_dict` counts the batches)."""
        check_not_rewrapped(self.claimed_by_loader)
        self.worker_iterations.note_iteration()
        if self.batch_size is None and self.config.max_tokens is None:
            raise ValueError(f"StreamingDataset iterated without a StreamingDataLoader {NEEDS_BATCH_SIZE}")
        topology = self.resolve_topology()
        check_not_resharded(topology.world_size)
        start, partitions, quarantine = self._resume or (
            0, self.resolve_partitions(topology), tuple((s, 0, 0) for s in self.listed_quarantine))
        self.pin_global_batch((self.batch_size or 1) * topology.world_size)
        plan = IterationPlan(epoch=self.epoch, start=start, batch_size=self.batch_size or 1, topology=topology,
                             num_partitions=partitions, quarantine=quarantine)
        if self.config.max_tokens is None:
            self.check_batch_fits(plan.batch_size, topology)
        check_worker_steps(self._loaded_steps_batch, plan.batch_size * topology.world_size)
        for batch in self._batches(plan.epoch, start, plan, *_worker(), skip=self._steps_done):
            self._steps_done += 1  # before handing out: a state saved after receiving this batch includes it
            yield batch_to_tensors(strip_progress(batch), self.config.token_dtype)
        self.epoch, self._steps_done, self._resume, self._loaded_steps_batch = self.epoch + 1, 0, None, None

    def _batches(self, epoch: int, start: int, plan: IterationPlan, worker: int, num_workers: int, *,
                 segments: tuple[tuple[int, int], ...] = (), limit: int | None = None,
                 skip: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """The numpy batches this reader reads of `epoch` from position `start` (the step source chosen once
        by the config: token-budget windows, or fixed-size steps at most `limit` of them)."""
        if self.config.max_tokens is not None:
            return token_batches(self.reader, self.order(epoch, plan.num_partitions, plan.quarantine), epoch=epoch,
                                 start=start, segments=segments, plan=plan, worker=worker, num_workers=num_workers,
                                 skip=skip, max_tokens=self.config.max_tokens, token_window=self.config.token_window)
        return self.reader.batches(self.chunk_ids(epoch, start, plan, worker, num_workers, limit, skip), plan.topology)

    def chunk_ids(self, epoch: int, start: int, plan: IterationPlan, worker: int, num_workers: int,
                  limit: int | None = None, skip: int = 0) -> Iterator[np.ndarray]:
        """Sample ids [steps, batch] of this rank's batches of `epoch`, a chunk of `chunk_samples` at a time, in
        order (see `shardkit.loaders.rank_steps.rank_step_ids` for `limit` and `skip`)."""
        return rank_step_ids(self.order(epoch, plan.num_partitions, plan.quarantine), start=start, plan=plan,
                             policy=self.config.partial_batches, chunk_samples=self.config.chunk_samples,
                             worker=worker, num_workers=num_workers, limit=limit, skip=skip)

    def rank_shards(self, order: Order, *, start: int, steps: int, plan: IterationPlan) -> list[int]:
        """Shards this rank reads in the first `steps` steps from `start` (in the order it needs them)."""
        shards: dict[int, None] = {}
        for ids in rank_step_ids(order, start=start, plan=plan, policy=self.config.partial_batches,
                                 chunk_samples=self.config.chunk_samples, limit=steps):
            shards.update(dict.fromkeys(self.reader.shards_in_order(ids)))
        return list(shards)


def _worker() -> tuple[int, int]:
    """(this DataLoader worker, number of workers); (0, 1) outside workers."""
    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)
