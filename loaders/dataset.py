"""`StreamingDataset`: a torch IterableDataset that yields whole batches of this rank's share.

Every decision about which sample goes where is delegated to pure functions (`order`,
`partition`, `mixing`); this module only wires them to the node-local cache and to torch. The
iterator produces *whole batches* so that, with DataLoader workers, one batch crosses the process
boundary as a handful of tensors instead of `batch_size` pickled samples.

The dataset is usually driven by `StreamingDataLoader`, which resolves the topology in the main
process, tells the dataset where to start (epoch, consumed positions) and counts what the training
loop received. Iterated on its own, it needs `batch_size` and starts each iteration at the next epoch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from shardkit import metrics
from shardkit.formats.sample import numpy_token_dtype
from shardkit.loaders.batching import ShardTable, gather_fixed, gather_variable
from shardkit.loaders.cache import ShardCache
from shardkit.loaders.mixing import MixtureOrder, Stream
from shardkit.loaders.config import LOADER_FIELDS, LoaderConfig, loader_config
from shardkit.loaders.order import EpochOrder, OrderConfig
from shardkit.loaders.partition import partial_batch, rank_positions, steps_in_epoch, worker_of_step, worker_steps
from shardkit.loaders.quarantine import filter_order, resolve_quarantine_list
from shardkit.loaders.token_budget import plan_remaining
from shardkit.loaders.topology import Topology, check_topology_args, resolve_topology
from shardkit.manifest import Manifest, load_manifest
from shardkit.storage import Storage

logger = logging.getLogger(__name__)

PROGRESS_KEY = "_progress"  # token-budget batches carry (window start, steps done, window finished)
_PREFETCH_THREADS = 4


@dataclass(frozen=True, kw_only=True)
class IterationPlan:
    """Where the next iteration starts and who reads it (set by the loader in the main process)."""

    epoch: int
    start: int
    batch_size: int
    topology: Topology
    num_partitions: int
    numpy_batches: bool = False  # the loader converts to tensors itself, after any process boundary
    bundle: int = 1  # with workers: consecutive batches sent as one list (one pipe message)
    segments: tuple[tuple[int, int], ...] = ()  # token-budget mode: (world_size, steps) done in the first window
    quarantine: tuple[tuple[int, int, int], ...] = ()  # (shard, epoch, position) left out (loaders.quarantine)
    steps: int | None = None  # read at most this many steps of the first epoch (on_corrupt="skip": one segment)


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
        self.streams = streams = _streams_of(source)
        self._topology_args = dict(rank=rank, world_size=world_size, local_rank=local_rank,
                                   local_world_size=local_world_size)
        check_topology_args(**self._topology_args)
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.storages = [Storage(s.url, s.storage_options if s.storage_options is not None else storage_options)
                         for s in streams]
        self.manifests: list[Manifest] = [load_manifest(st) for st in self.storages]
        self._check_compatible()
        first = self.manifests[0]
        self.sample_length = first.sample_length
        self.token_dtype = numpy_token_dtype(first.token_dtype)
        self.has_doc_boundaries = all(sh.has_doc_boundaries for m in self.manifests for sh in m.shards)
        tok = first.tokenizer
        self.pad_id = next((i for i in (tok.pad_id, tok.eos_id) if i is not None), 0)
        self.caches = [ShardCache(st, m, cache_dir, cache_limit=config.cache_limit, wait_timeout=config.cache_wait)
                       for st, m in zip(self.storages, self.manifests)]
        self._shard_owner = [(s, i) for s, m in enumerate(self.manifests) for i in range(len(m.shards))]
        self.table = ShardTable([sh.samples for m in self.manifests for sh in m.shards])
        self.num_samples = sum(m.num_samples for m in self.manifests)
        if config.epoch_size is not None and len(streams) == 1:
            raise ValueError("epoch_size applies to mixtures of several Streams only")
        self.batch_size = batch_size
        longest = max((m.max_sample_tokens or 0) for m in self.manifests)
        if config.max_tokens is not None and longest > config.max_tokens:
            raise ValueError(f"max_tokens={config.max_tokens} is below the longest sample the manifests allow "
                             f"(max_sample_tokens={longest}); raise max_tokens")
        self._group_args = dict(process_group=process_group, device_mesh=device_mesh, mesh_dim=mesh_dim)
        if config.on_corrupt == "skip" and config.max_tokens is not None:
            raise ValueError("on_corrupt='skip' is not supported with max_tokens (token-budget batching) yet; "
                             "use a quarantine_list, or on_corrupt='raise'")
        self.listed_quarantine = (resolve_quarantine_list(config.quarantine_list, self.manifests,
                                                          [s.url for s in streams])
                                  if config.quarantine_list is not None else ())
        self._filtered: dict[tuple, Any] = {}
        self._plan: IterationPlan | None = None
        self._iterations = 0
        self.epoch = 0

    def _check_compatible(self) -> None:
        first = self.manifests[0]
        for stream, manifest in zip(self.streams[1:], self.manifests[1:]):
            for attr in ("token_dtype", "sample_length"):
                if getattr(manifest, attr) != getattr(first, attr):
                    raise ValueError(f"stream {stream.url}: {attr}={getattr(manifest, attr)!r} differs from "
                                     f"{self.streams[0].url} ({getattr(first, attr)!r}); "
                                     "streams of a mixture must agree")
            tok, ref = manifest.tokenizer, first.tokenizer
            if tok.vocab_size != ref.vocab_size or tok.name != ref.name:
                raise ValueError(f"stream {stream.url} uses tokenizer {manifest.tokenizer.name} "
                                 f"({manifest.tokenizer.vocab_size} ids), {self.streams[0].url} uses "
                                 f"{first.tokenizer.name} ({first.tokenizer.vocab_size} ids)")

    def __getstate__(self) -> dict:
        # Process groups and meshes do not pickle; workers get the topology through the plan.
        state = self.__dict__.copy()
        state["_group_args"] = dict.fromkeys(self._group_args)
        return state

    # -- configuration -------------------------------------------------------------------------
    def resolve_topology(self) -> Topology:
        """Rank, world and node layout, resolved now (see `shardkit.loaders.topology`)."""
        return resolve_topology(**self._topology_args, **self._group_args)

    def resolve_partitions(self, topology: Topology) -> int:
        return self.num_partitions if self.num_partitions is not None else topology.num_nodes

    def order_config(self, num_partitions: int) -> OrderConfig:
        return self.config.order_config(num_partitions)

    def order(self, epoch: int, num_partitions: int, quarantine: tuple[tuple[int, int, int], ...] = ()):
        """The global order of `epoch` (pure function of manifests, seed, epoch and partitions), without the
        positions of quarantined shards (`quarantine` entries, see `shardkit.loaders.quarantine`)."""
        config = self.order_config(num_partitions)
        if len(self.manifests) == 1:
            order = EpochOrder([sh.samples for sh in self.manifests[0].shards], config, epoch)
        else:
            order = MixtureOrder([[sh.samples for sh in m.shards] for m in self.manifests],
                                 [s.weight for s in self.streams], config, epoch, self.epoch_size)
        if not quarantine:
            return order
        key = (epoch, num_partitions, tuple(quarantine))
        if key not in self._filtered:  # a filter scans the epoch's order: keep the last few
            if len(self._filtered) >= 4:
                self._filtered.pop(next(iter(self._filtered)))
            self._filtered[key] = filter_order(order, self.table.ends, quarantine, epoch)
        return self._filtered[key]

    def shard_owner(self, index: int) -> tuple[int, int]:
        """(stream, shard within the stream) of shard `index` over all streams."""
        return self._shard_owner[index]

    def agreement_group(self) -> Any:
        """The data-parallel process group (None: the default group)."""
        mesh, dim = self._group_args["device_mesh"], self._group_args["mesh_dim"]
        if mesh is not None:
            return mesh.get_group(dim) if dim is not None else mesh.get_group()
        return self._group_args["process_group"]

    def fingerprint(self) -> str:
        """Identity of the data (shard names, sizes and hashes, stream weights), not of its location."""
        content = [[[sh.name, sh.samples, sh.sha256] for sh in m.shards] for m in self.manifests]
        weights = [s.weight for s in self.streams] if len(self.streams) > 1 else []
        return hashlib.sha256(json.dumps([content, weights]).encode()).hexdigest()[:32]

    def set_epoch(self, epoch: int) -> None:
        """Epoch of the next standalone iteration (the loader manages epochs itself)."""
        self.epoch = epoch
        self._iterations = 0

    def set_plan(self, plan: IterationPlan) -> None:
        """Where the next iteration starts; later iterations (persistent workers) take later epochs."""
        self._plan = plan
        self._iterations = 0

    @property
    def positions_per_epoch(self) -> int:
        """Samples in one epoch's order (a mixture's epoch_size, else all samples)."""
        return self.num_samples if len(self.streams) == 1 else (self.epoch_size or self.num_samples)

    def batches_per_epoch(self, batch_size: int, topology: Topology, start: int = 0,
                          num_positions: int | None = None) -> int:
        """Steps left from `start` in an epoch of `num_positions` (default: `positions_per_epoch`)."""
        return steps_in_epoch(self.positions_per_epoch if num_positions is None else num_positions, start=start,
                              global_batch=batch_size * topology.world_size, policy=self.partial_batches)

    def check_batch_fits(self, batch_size: int, topology: Topology) -> None:
        """Raise when an epoch holds no whole global batch (iteration would silently yield nothing).

        Raises:
            ValueError: naming batch_size, the world size and the samples per epoch.
        """
        if self.batches_per_epoch(batch_size, topology) == 0:
            raise ValueError(f"batch_size={batch_size} x world_size={topology.world_size} is larger than the "
                             f"{self.positions_per_epoch} samples of an epoch: no batch would be yielded with "
                             f"partial_batches={self.partial_batches!r}; lower batch_size or use partial_batches='pad'")

    def __len__(self) -> int:
        if self.max_tokens is not None:
            raise TypeError("token-budget batches per epoch depend on the sample lengths: unknown before reading")
        if self.batch_size is None:
            raise TypeError("len(StreamingDataset) needs batch_size; use len(StreamingDataLoader)")
        return self.batches_per_epoch(self.batch_size, self.resolve_topology())

    # -- iteration -----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor] | dict[str, np.ndarray]]:
        plan = self._plan
        if plan is None:
            if self.batch_size is None and self.max_tokens is None:
                raise ValueError("StreamingDataset needs batch_size= when iterated without StreamingDataLoader")
            topology = self.resolve_topology()
            plan = IterationPlan(epoch=self.epoch, start=0, batch_size=self.batch_size or 1, topology=topology,
                                 num_partitions=self.resolve_partitions(topology),
                                 quarantine=tuple((s, 0, 0) for s in self.listed_quarantine))
            if self.max_tokens is None:
                self.check_batch_fits(plan.batch_size, topology)
        offset, self._iterations = self._iterations, self._iterations + 1
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        start = plan.start if offset == 0 else 0
        if self.max_tokens is not None:
            batches = self._generate_tokens(plan.epoch + offset, start, plan.segments if offset == 0 else (), plan,
                                            worker, num_workers)
        else:
            batches = self._generate(plan.epoch + offset, start, plan, worker, num_workers,
                                     limit=plan.steps if offset == 0 else None)
        if info is not None and plan.bundle > 1:
            return bundled(batches, plan.bundle)
        return batches if plan.numpy_batches else (batch_to_tensors(strip_progress(b)) for b in batches)

    def _step_chunks(self, order: Any, start: int, steps: np.ndarray, plan: IterationPlan) -> list[np.ndarray]:
        """`steps` cut into chunks of `chunk_samples`; the smaller last step of "partial" alone in its chunk."""
        total = steps_in_epoch(order.num_positions, start=start, global_batch=plan.batch_size * plan.topology.world_size,
                               policy=self.partial_batches)
        per_chunk = max(1, self.chunk_samples // plan.batch_size)
        tail = []
        if self._last_batch(order, start, plan) is not None and len(steps) and steps[-1] == total - 1:
            steps, tail = steps[:-1], [steps[-1:]]
        return [steps[i:i + per_chunk] for i in range(0, len(steps), per_chunk)] + tail

    def _last_batch(self, order: Any, start: int, plan: IterationPlan) -> int | None:
        return partial_batch(order.num_positions, start=start, global_batch=plan.batch_size * plan.topology.world_size,
                             world_size=plan.topology.world_size, policy=self.partial_batches)

    def _step_ids(self, order: Any, start: int, chunk_steps: np.ndarray, plan: IterationPlan) -> np.ndarray:
        """This rank's sample ids [steps, batch] of one chunk of `_step_chunks`."""
        topo, batch = plan.topology, plan.batch_size
        last = self._last_batch(order, start, plan)
        total = steps_in_epoch(order.num_positions, start=start, global_batch=batch * topo.world_size,
                               policy=self.partial_batches)
        width = last if last is not None and chunk_steps[-1] == total - 1 else batch
        positions = rank_positions(chunk_steps, start=start, num_positions=order.num_positions,
                                   world_size=topo.world_size, batch_size=width, rank=topo.rank,
                                   partition_of=order.partition_of, stride=batch * topo.world_size)
        # Rows of a batch in sample-id order: runs per shard, copied in one pass (batching.py).
        ids = order.sample_ids(positions)
        ids.sort(axis=1)
        return ids

    def steps_left(self, order: Any, start: int, plan: IterationPlan) -> int:
        return steps_in_epoch(order.num_positions, start=start, global_batch=plan.batch_size * plan.topology.world_size,
                              policy=self.partial_batches)

    def rank_shards(self, order: Any, *, start: int, steps: int, plan: IterationPlan) -> list[int]:
        """Shards this rank reads in the first `steps` steps from `start` (in the order it needs them)."""
        wanted = np.arange(min(steps, self.steps_left(order, start, plan)), dtype=np.int64)
        shards: dict[int, None] = {}
        for chunk in self._step_chunks(order, start, wanted, plan):
            shards.update(dict.fromkeys(self._shards_in_order(self._step_ids(order, start, chunk, plan))))
        return list(shards)

    def _generate(self, epoch: int, start: int, plan: IterationPlan, worker: int, num_workers: int,
                  limit: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        order = self.order(epoch, plan.num_partitions, plan.quarantine)
        total = self.steps_left(order, start, plan)
        if limit is not None:  # a bounded iteration (on_corrupt="skip": one checked segment)
            total = min(total, limit)
        steps = worker_steps(total, worker=worker, num_workers=num_workers, bundle=plan.bundle)
        chunks = self._step_chunks(order, start, steps, plan)
        topo = plan.topology

        def ids_of(chunk_steps: np.ndarray) -> np.ndarray:
            return self._step_ids(order, start, chunk_steps, plan)

        held: dict[int, Any] = {}
        executor = (ThreadPoolExecutor(_PREFETCH_THREADS, thread_name_prefix="shardkit-prefetch")
                    if self.prefetch else None)
        try:
            upcoming = ids_of(chunks[0]) if chunks else None
            for c in range(len(chunks)):
                ids = upcoming
                upcoming = ids_of(chunks[c + 1]) if c + 1 < len(chunks) else None
                needed = self._shards_in_order(ids)
                if executor is not None:
                    self._prefetch(executor, needed, topo)
                    if upcoming is not None:
                        self._prefetch(executor, self._shards_in_order(upcoming), topo)
                for index in needed:
                    if index not in held:
                        stream, local = self._shard_owner[index]
                        held[index] = self.caches[stream].open(local)
                keep = set(needed) | (set(self._shards_in_order(upcoming)) if upcoming is not None else set())
                yield from self._batches(ids, held)
                for index in [i for i in held if i not in keep]:
                    held.pop(index).close()
        finally:
            for handle in held.values():
                handle.close()
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)

    def _generate_tokens(self, epoch: int, start: int, segments: tuple[tuple[int, int], ...], plan: IterationPlan,
                         worker: int, num_workers: int) -> Iterator[dict[str, np.ndarray]]:
        """Token-budget batches: plan each window of the global order (see `token_budget`)."""
        order = self.order(epoch, plan.num_partitions, plan.quarantine)
        topo, total = plan.topology, order.num_positions
        step = 0  # steps of this iteration, dealt round robin to the DataLoader workers
        held: dict[int, Any] = {}
        rank_tokens, repeats = np.zeros(topo.world_size, dtype=np.int64), 0
        try:
            for window_start in range(start, total, self.token_window):
                ids = order.sample_ids(np.arange(window_start, min(window_start + self.token_window, total)))
                needed = self._shards_in_order(ids)
                for index in [i for i in held if i not in set(needed)]:
                    held.pop(index).close()
                for index in needed:
                    if index not in held:
                        stream, local = self._shard_owner[index]
                        held[index] = self.caches[stream].open(local)
                lengths = self._lengths(ids, held)
                first = window_start == start
                prior = segments if first else ()
                skip = 0
                if prior and prior[-1][0] == topo.world_size:  # same world: continue the same plan
                    prior, skip = prior[:-1], prior[-1][1]
                window_plan, covered = plan_remaining(lengths, prior, world_size=topo.world_size,
                                                      max_tokens=self.max_tokens)
                mine = window_plan.batches[topo.rank]
                rank_tokens += window_plan.rank_tokens
                repeats += window_plan.repeats
                for k in range(skip, window_plan.steps):
                    if worker_of_step(step, num_workers=num_workers, bundle=plan.bundle) == worker:
                        rows = mine[k]
                        rows = np.where(rows < 0, window_plan.filler, rows)
                        batch = gather_variable(ids[covered[rows]], table=self.table,
                                                reader_of=lambda i: held[i].reader, token_dtype=self.token_dtype,
                                                pad_id=self.pad_id, with_segments=self.has_doc_boundaries)
                        batch[PROGRESS_KEY] = np.array([window_start, k + 1, k + 1 == window_plan.steps],
                                                       dtype=np.int64)
                        yield batch
                    step += 1
            if worker == 0 and rank_tokens.sum():
                logger.info("epoch %d (token budget %d): %d steps, token imbalance across ranks %.2f%% "
                            "(max / mean - 1), %d repeated samples filled empty batches", epoch, self.max_tokens,
                            step, 100 * (rank_tokens.max() / rank_tokens.mean() - 1), repeats)
        finally:
            for handle in held.values():
                handle.close()

    def _lengths(self, ids: np.ndarray, held: dict[int, Any]) -> np.ndarray:
        shard, local = self.table.locate(ids)
        lengths = np.empty(len(ids), dtype=np.int64)
        for index in np.unique(shard):
            rows = np.flatnonzero(shard == index)
            offsets = held[int(index)].reader.arrays.sample_offsets
            lengths[rows] = offsets[local[rows] + 1] - offsets[local[rows]]
        return lengths

    def _shards_in_order(self, ids: np.ndarray) -> list[int]:
        shards = np.searchsorted(self.table.ends, ids.reshape(-1), side="right")
        uniq, first = np.unique(shards, return_index=True)
        return [int(s) for s in uniq[np.argsort(first)]]

    def _prefetch(self, executor: ThreadPoolExecutor, shards: list[int], topo: Topology) -> None:
        # Each local rank starts with the shards it "owns", so a node's processes download
        # different shards in parallel instead of queueing on the same lock.
        mine = [s for s in shards if s % topo.local_world_size == topo.local_rank]
        others = [s for s in shards if s % topo.local_world_size != topo.local_rank]
        for index in mine + others:
            stream, local = self._shard_owner[index]
            if not self.caches[stream].is_cached(local):
                metrics.prefetch_submitted()
                executor.submit(self._prefetch_one, stream, local).add_done_callback(metrics.prefetch_done)

    def _prefetch_one(self, stream: int, local: int) -> None:
        try:
            self.caches[stream].prefetch(local)
        except Exception as err:  # noqa: BLE001 - the reader retries and reports it in the foreground
            logger.debug("prefetch of shard %s failed: %s", self.manifests[stream].shards[local].name, err)

    def _batches(self, ids: np.ndarray, held: dict[int, Any]) -> Iterator[dict[str, np.ndarray]]:
        def reader_of(index: int):
            return held[index].reader

        if self.sample_length is not None:
            arrays = gather_fixed(ids, table=self.table, reader_of=reader_of, length=self.sample_length,
                                  token_dtype=self.token_dtype, with_segments=self.has_doc_boundaries)
            batch = ids.shape[1]
            items = list(arrays.items())
            for b in range(ids.shape[0]):
                rows = slice(b * batch, (b + 1) * batch)
                yield {k: v[rows] for k, v in items}
        else:
            for row in ids:
                yield gather_variable(row, table=self.table, reader_of=reader_of, token_dtype=self.token_dtype,
                                      pad_id=self.pad_id, with_segments=self.has_doc_boundaries)


def _streams_of(source: Any) -> list[Stream]:
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if isinstance(source, str):
        source = Stream(source)
    if isinstance(source, Stream):
        return [source]
    streams = list(source) if isinstance(source, (list, tuple)) else None
    if not streams or not all(isinstance(s, Stream) for s in streams):
        raise TypeError(f"source must be a dataset URL (str), a Stream, or a non-empty list of Stream, "
                        f"got {type(source).__name__} {source!r}"[:300])
    return streams


# The options read as attributes (`dataset.shuffle`, `dataset.max_tokens`, ...), all from `config`.
for _name in sorted(LOADER_FIELDS):
    setattr(StreamingDataset, _name, property(lambda self, _n=_name: getattr(self.config, _n)))


def bundled(batches: Iterator[dict[str, np.ndarray]], size: int) -> Iterator[list[dict[str, np.ndarray]]]:
    """Group a worker's batches into lists of `size` (its steps come in bundles of that many)."""
    bundle: list[dict[str, np.ndarray]] = []
    for batch in batches:
        bundle.append(batch)
        if len(bundle) == size:
            yield bundle
            bundle = []
    if bundle:
        yield bundle


def strip_progress(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    batch.pop(PROGRESS_KEY, None)
    return batch


def batch_to_tensors(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Wrap a batch's arrays as tensors without copying."""
    return {k: torch.from_numpy(v) for k, v in batch.items()}
