"""Reading batches of sample ids from the node-local cache: the shards a chunk needs are held, the next
chunk's prefetched, and the rows gathered (`shardkit.loaders.sources.built.batching`).

`BatchReader` is the dataset's I/O half: it gets its collaborators (the shard table, the caches, which
stream owns a shard, the batch format) explicitly and decides nothing about the order; the dataset hands
it the sample ids of each chunk (fixed-size steps) or the epoch's order (token-budget steps).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from shardkit import metrics
from shardkit.formats import ShardArrays, ShardReader
from shardkit.formats.sample import concat_arrays
from shardkit.manifest import Manifest

from ...order.shard_table import ShardTable
from .batching import gather_fixed, gather_variable, group_rows
from ...delivery.closing import closed_at_exit
from ...delivery.topology import Topology

logger = logging.getLogger(__name__)

_PREFETCH_THREADS = 4
_GOLDEN = (5**0.5 - 1) / 2
_COLD_STEP_BATCHES = 32  # most batches gathered per block check while shards arrive block by block


class BatchReader:
    """Batches of given sample ids, read through the node-local caches.

    Args:
        table: global sample ids <-> (shard, index in shard) over every stream.
        caches: one `ShardCache` per stream.
        shard_owner: (stream, shard in the stream) of a global shard index.
        manifests: one per stream (shard names for logs).
        sample_length: tokens per sample (None: variable-length samples).
        token_dtype, pad_id: the batch's token dtype and padding id (variable-length data).
        with_segments: the shards store document boundaries (batches carry cu_seqlens).
        dense_segments: batches also carry dense segment_ids.
        prefetch: download upcoming shards in background threads.
    """

    def __init__(self, *, table: ShardTable, caches: Sequence[Any], shard_owner: ShardOwners, manifests: Sequence[Manifest],
                 sample_length: int | None, token_dtype: np.dtype, pad_id: int, with_segments: bool,
                 dense_segments: bool, prefetch: bool):
        self.table, self.caches, self.shard_owner, self.manifests = table, caches, shard_owner, manifests
        self.sample_length, self.token_dtype, self.pad_id = sample_length, token_dtype, pad_id
        self.with_segments, self.dense_segments, self.prefetch = with_segments, dense_segments, prefetch

    @closed_at_exit
    def batches(self, chunks: Iterator[np.ndarray], topo: Topology) -> Iterator[dict[str, np.ndarray]]:
        """The batches of `chunks` (sample ids [steps, batch], in order): holds the shards a chunk needs
        and prefetches the next chunk's while it is read."""
        held: dict[int, Any] = {}
        executor = (ThreadPoolExecutor(_PREFETCH_THREADS, thread_name_prefix="shardkit-prefetch")
                    if self.prefetch else None)
        first = True
        try:
            upcoming = next(chunks, None)
            while upcoming is not None:
                ids = upcoming
                upcoming = next(chunks, None)  # one chunk ahead: its shards are prefetched now
                needed = self.shards_in_order(ids)
                # Let go of the last chunk's shards that neither this chunk nor the next reads before opening
                # this chunk's: under cache_limit an open may wait for room, and the node's readers would wait
                # on each other while each pinned shards it is done with.
                keep = set(needed) | (set(self.shards_in_order(upcoming)) if upcoming is not None else set())
                for index in [i for i in held if i not in keep]:
                    held.pop(index).close()
                if executor is not None:
                    # Shards read block by block complete themselves: prefetching them whole now would
                    # make the first batch wait for whole shards.
                    self._prefetch(executor, [i for i in needed if not self._serves_blocks(i)], topo)
                self.hold(needed, held)
                batches = self._batches(ids, held, ramp=first)
                if first:  # an iteration's first batch has the link to itself: the next chunk's shards come after it
                    yield from itertools.islice(batches, 1)
                if executor is not None and upcoming is not None:  # after the opens, for the same reason
                    self._prefetch(executor, self.shards_in_order(upcoming), topo)
                yield from batches
                first = False
        finally:
            for handle in held.values():
                handle.close()
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)

    def hold(self, needed: list[int], held: dict[int, Any]) -> None:
        """Open the shards `needed` that `held` lacks (a read on demand: they may still be arriving)."""
        for index in needed:
            if index not in held:
                stream, local = self.shard_owner[index]
                held[index] = self.caches[stream].open(local, on_demand=True)

    def lengths(self, ids: np.ndarray, held: dict[int, Any]) -> np.ndarray:
        """Tokens of each sample `ids` (from the held shards' offsets)."""
        shard, local = self.table.locate(ids)
        lengths = np.empty(len(ids), dtype=np.int64)
        for index in np.unique(shard):
            rows = np.flatnonzero(shard == index)
            offsets = held[int(index)].reader.arrays.sample_offsets
            lengths[rows] = offsets[local[rows] + 1] - offsets[local[rows]]
        return lengths

    def shards_in_order(self, ids: np.ndarray) -> list[int]:
        shards = np.searchsorted(self.table.ends, ids.reshape(-1), side="right")
        uniq, first = np.unique(shards, return_index=True)
        return [int(s) for s in uniq[np.argsort(first)]]

    def _prefetch(self, executor: ThreadPoolExecutor, shards: list[int], topo: Topology) -> None:
        for index in prefetch_order(shards, topo):
            stream, local = self.shard_owner[index]
            if self.caches[stream].needs_prefetch(local):
                metrics.prefetch_submitted()
                executor.submit(self._prefetch_one, stream, local).add_done_callback(metrics.prefetch_done)

    def _prefetch_one(self, stream: int, local: int) -> None:
        try:
            self.caches[stream].prefetch(local)
        except Exception as err:  # noqa: BLE001 - the reader retries and reports it in the foreground
            logger.debug("prefetch of shard %s failed: %s", self.manifests[stream].shards[local].name, err)

    def _serves_blocks(self, index: int) -> bool:
        stream, local = self.shard_owner[index]
        cache = self.caches[stream]
        return cache._serves_blocks(local, cache.path(local))

    def ensure(self, ids: np.ndarray, held: dict[int, Any]) -> None:
        """Make the samples `ids` readable in shards still arriving block by block (cold format v2 shards)."""
        shard, local = self.table.locate(np.asarray(ids, dtype=np.int64).reshape(-1))
        # dict.fromkeys, not np.unique: numpy 2.4's unique imports numpy.ma (~20 ms) on its first call, inside
        # the first batch of a fresh process.
        cold = [(held[index], local[shard == index]) for index in dict.fromkeys(shard.tolist())
                if not held[index].complete]
        # Every shard's reads at once: first the block indexes (each read needs its shard's index), then
        # the blocks, so a batch spanning several cold shards waits for two round trips, not two per shard.
        for handle, _ in cold:
            handle.start_index()
        for request in [handle.request(samples) for handle, samples in cold]:
            request.wait()

    def _batches(self, ids: np.ndarray, held: dict[int, Any], *, ramp: bool = False) -> Iterator[dict[str, np.ndarray]]:
        incomplete = [held[i] for i in self.shards_in_order(ids) if not held[i].complete]
        b, step = 0, 1
        if ramp and incomplete and len(ids):
            yield from self._first_batch(ids[:1], held)
            b, step = 1, 2
            incomplete = [h for h in incomplete if not h.complete]
        while (incomplete or ramp and step < _COLD_STEP_BATCHES) and b < len(ids):
            # Cold shards: fetch what the next batches need just before them, so the first batch waits for
            # its own blocks only (a chunk spans most blocks of a shuffled shard); then 2, 4, ... batches at
            # a time, which amortises the per-call cost, until the shards are whole. `ramp` (an iteration's
            # first chunk): the same doubling on warm shards, so the first batch waits for one batch's
            # gather, not a whole chunk's.
            rows = ids[b:b + step]
            if incomplete:
                self.ensure(rows, held)
            yield from self._gather(rows, held)
            b, step = b + len(rows), min(2 * step, _COLD_STEP_BATCHES)
            incomplete = [h for h in incomplete if not h.complete]
        if b < len(ids):
            yield from self._gather(ids[b:], held)

    def _first_batch(self, rows: np.ndarray, held: dict[int, Any]) -> Iterator[dict[str, np.ndarray]]:
        """The first batch of an iteration over shards still arriving block by block, gathered from its samples'
        decoded blocks rather than from the shards' arrays (`BlockReader.request_samples`: placing the blocks
        there first cost as much as decoding them). Its samples become a small shard of their own, in row
        order, gathered like any other; the batch carries the real sample ids."""
        flat = rows.reshape(-1)
        shard, local = self.table.locate(flat)
        groups = group_rows(shard)
        # Every shard's reads at once, as `ensure` does: the block indexes first, then the blocks.
        for index, _ in groups:
            held[index].start_index()
        requests = [(positions, held[index].request_samples(local[positions])) for index, positions in groups]
        parts: list[Any] = [None] * len(flat)
        for positions, wait in requests:
            for position, arrays in zip(positions.tolist(), wait()):
                # Without segments in the batch (a stream of a mixture without document boundaries) none are kept.
                parts[position] = arrays if self.with_segments else ShardArrays(arrays.tokens, arrays.sample_offsets)
        samples = ShardReader(concat_arrays(parts, self.token_dtype.name), name="first batch")
        positions = np.arange(len(flat), dtype=np.int64).reshape(rows.shape)
        for batch in self._gather_from(positions, lambda _: samples, ShardTable([len(flat)])):
            batch["sample_id"] = flat[batch["sample_id"]]
            yield batch

    def gather_rows(self, ids: np.ndarray, held: dict[int, Any]) -> dict[str, np.ndarray]:
        """One batch of the samples `ids` (any lengths: padded rows), from the held shards."""
        return self._gather_variable(ids, lambda i: held[i].reader, self.table)

    def _gather_variable(self, ids: np.ndarray, reader_of: Callable[[int], ShardReader],
                         table: ShardTable) -> dict[str, np.ndarray]:
        return gather_variable(ids, table=table, reader_of=reader_of, token_dtype=self.token_dtype,
                               pad_id=self.pad_id, with_segments=self.with_segments,
                               dense_segments=self.dense_segments)

    def _gather(self, ids: np.ndarray, held: dict[int, Any]) -> Iterator[dict[str, np.ndarray]]:
        return self._gather_from(ids, lambda index: held[index].reader, self.table)

    def _gather_from(self, ids: np.ndarray, reader_of: Callable[[int], ShardReader],
                     table: ShardTable) -> Iterator[dict[str, np.ndarray]]:
        """The batches of `ids` ([steps, batch]), located by `table` and read through `reader_of`."""
        if self.sample_length is not None:
            yield from gather_fixed(ids, table=table, reader_of=reader_of, length=self.sample_length,
                                    token_dtype=self.token_dtype, with_segments=self.with_segments,
                                    batch=ids.shape[1], dense_segments=self.dense_segments)
        else:
            for row in ids:
                yield self._gather_variable(row, reader_of, table)


def prefetch_order(shards: list[int], topo: Topology) -> list[int]:
    """The order in which this process asks for `shards` (the samples' order is not affected).

    Each node starts at its own deterministic offset in the list (a golden-ratio stride over node
    numbers), so nodes that need the same shards do not all ask the store for the first one at once;
    then each local rank starts with the shards it "owns", so a node's processes download different
    shards in parallel instead of queueing on the same lock.
    """
    if len(shards) > 1:
        offset = int(len(shards) * ((topo.node * _GOLDEN) % 1.0))  # node k at frac(k x 0.618...): well spread
        shards = shards[offset:] + shards[:offset]
    mine = [s for s in shards if s % topo.local_world_size == topo.local_rank]
    return mine + [s for s in shards if s % topo.local_world_size != topo.local_rank]


class ShardOwners:
    """(stream, shard index in its manifest) of each global shard index, by arithmetic on the streams'
    shard counts (no per-shard object, whatever the number of shards)."""

    def __init__(self, shard_counts: Sequence[int]):
        self._ends = np.cumsum(np.asarray(shard_counts, dtype=np.int64))

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def __getitem__(self, index: int) -> tuple[int, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"shard {index} is outside [0, {len(self)})")
        stream = int(np.searchsorted(self._ends, index, side="right"))
        return stream, int(index - (self._ends[stream - 1] if stream else 0))


