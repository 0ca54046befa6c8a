"""The order of a mixture with raw-text streams: which stream item each global position is, which rows each rank
reads, and the items' sample ids. Pure functions of the streams' shape, weights and seed; no I/O.

Position i of the mixture is item k of stream s (`MixturePlan.items_at`: the built mixtures' integer quotas and
smooth interleave, counted from the run's start, or from a mid-run weight change (the plan's anchor) with each
stream's count there; endless, since raw text has no epoch end; a weight `Schedule` changes the quotas at its
steps, of the first run's global batch each). A raw stream's item k
is sample k // lanes of its lane k % lanes, as in a raw dataset of its own; a built stream's item k is item
k mod n of its epoch k // n, in that epoch's order (`EpochOrder`, seeded per stream as `MixtureOrder` seeds it).

A job consumes positions in global steps of world_size x batch_size. Inside a step the positions are sorted by
group (each raw lane is a group, each built shard one) and cut into world_size equal slices, as a raw dataset
cuts by lane: a rank tokenizes only the lanes its slice needs and opens few shards, and 1, 2 or 3 ranks read the
same rows.

Sample ids: a built stream's items keep the ids a built mixture of the built streams gives them (offset by the
samples of the built streams before it); raw stream r's item k (of R raw streams) is built_samples + k * R + r,
unique and endless. With one raw stream alone that is the position, as in a raw dataset.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from .shard_table import ShardTable
from ..config import OrderConfig
from .mixing import MixturePlan
from .epochs import EpochOrder
from .lanes import lane_sample_counts

ENDLESS = 1 << 62  # the plan's epoch size: positions are counted from the start, never wrapped
_SEED_STRIDE = 1_000_003  # a stream's seed offset per seed key (its first index), as `MixtureOrder` offsets it


@dataclass(frozen=True)
class StepRows:
    """One rank's rows of one step, in the rank's order: per row its global position, stream, item k of the
    stream, global lane (raw; -1 for built), sample of the lane (raw) or epoch of the stream (built), global
    built shard (-1 for raw) and sample id."""

    positions: np.ndarray
    stream: np.ndarray
    k: np.ndarray
    lane: np.ndarray
    index: np.ndarray
    shard: np.ndarray
    sample_id: np.ndarray

    def worker_of(self, num_workers: int) -> np.ndarray:
        """The DataLoader worker that reads each row: a raw row's by its lane, a built row's by its shard."""
        return np.where(self.lane >= 0, self.lane, self.shard) % num_workers


class MixedOrder:
    """The order of a mixture of raw-text and built streams.

    Args:
        plan: which stream item each position is (a mixture record's plan over `ENDLESS` positions, seed keys the
            streams' indices; weight `Schedule`s need `pin`).
        lanes: per stream, its lanes (raw text) or 0 (built).
        shard_sizes: per stream, samples per shard (built; None for raw text).
        seed, shuffle: the built streams' epoch orders (each stream's seed offset by its seed key).
    """

    def __init__(self, plan: MixturePlan, lanes: Sequence[int], shard_sizes: Sequence[np.ndarray | None], *,
                 seed: int, shuffle: bool):
        self.plan = self._checked(plan)
        self.lanes = np.asarray(lanes, dtype=np.int64)
        raw = self.lanes > 0
        self.num_raw = int(raw.sum())
        self.raw_index = np.where(raw, np.cumsum(raw) - 1, -1)
        self.lane_offsets = np.cumsum(self.lanes) - self.lanes
        self.total_lanes = int(self.lanes.sum())
        sizes = [np.zeros(0, dtype=np.int64) if r else np.asarray(s, dtype=np.int64)
                 for r, s in zip(raw, shard_sizes)]
        self.sizes = sizes
        self.samples = np.array([int(s.sum()) for s in sizes], dtype=np.int64)
        self.id_offsets = np.cumsum(self.samples) - self.samples
        self.built_samples = int(self.samples.sum())
        self.shard_offsets = np.cumsum([len(s) for s in sizes]) - np.array([len(s) for s in sizes])
        self.table = ShardTable.of_streams(sizes)
        self.seed, self.shuffle = seed, shuffle
        self._orders: OrderedDict[tuple[int, int], EpochOrder] = OrderedDict()

    @staticmethod
    def _checked(plan: MixturePlan) -> MixturePlan:
        if plan.global_batch is not None or not plan.has_schedule:
            plan.pieces  # the quotas now: a weight too small to be sampled is refused before any batch
        return plan

    @property
    def global_batch(self) -> int | None:
        return self.plan.global_batch

    def pin(self, global_batch: int, *, saved: bool = False) -> None:
        """Fix the positions per step that weight `Schedule`s count steps in: the first run's global batch (set
        once), or the one a loaded state `saved`."""
        if saved or self.plan.global_batch is None:
            self.plan = self._checked(replace(self.plan, global_batch=int(global_batch)))

    def follow(self, plan: MixturePlan) -> None:
        """Continue with `plan` (a mixture record's: the saved one, or one changed at the saved position)."""
        if len(plan.weights) != len(self.lanes):
            raise ValueError(f"a mixture plan of {len(plan.weights)} streams for a mixture of {len(self.lanes)}")
        self.plan = self._checked(plan)
        self._orders.clear()  # the built streams' orders follow the plan's seed keys

    def step_rows(self, step: int, *, start: int, world_size: int, batch_size: int, rank: int) -> StepRows:
        """The rows `rank` reads at `step` (counted from `start` consumed positions)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, {world_size})")
        if start < self.plan.anchor_position:
            raise ValueError(f"position {start} precedes the mixture change at position {self.plan.anchor_position}")
        global_batch = world_size * batch_size
        positions = start + step * global_batch + np.arange(global_batch, dtype=np.int64)
        stream, k = self.plan.items_at(self.plan.offsets(0, positions))
        raw = self.lanes[stream] > 0
        lane, index = self._raw_place(stream, k)
        sample_id = np.where(raw, self.built_samples + k * self.num_raw + np.maximum(self.raw_index[stream], 0), 0)
        built = np.flatnonzero(~raw)
        if len(built):
            sample_id[built], index[built] = self._built_ids(stream[built], k[built])
        shard = np.full(len(positions), -1, dtype=np.int64)
        shard[built] = self.table.locate(sample_id[built])[0]
        group = np.where(raw, lane, self.total_lanes + shard)
        mine = np.lexsort((positions, sample_id, group))[rank * batch_size:(rank + 1) * batch_size]
        return StepRows(positions=positions[mine], stream=stream[mine], k=k[mine], lane=lane[mine],
                        index=index[mine], shard=shard[mine], sample_id=sample_id[mine])

    def _built_ids(self, stream: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(global sample id, stream epoch) of item k of each built stream."""
        epoch, local = np.divmod(k, self.samples[stream])
        ids = np.empty_like(k)
        for s, e in {(int(s), int(e)) for s, e in zip(stream.tolist(), epoch.tolist())}:
            sel = (stream == s) & (epoch == e)
            ids[sel] = self._order(s, e).sample_ids(local[sel]) + self.id_offsets[s]
        return ids, epoch

    def _order(self, stream: int, epoch: int) -> EpochOrder:
        order = self._orders.get((stream, epoch))
        if order is None:
            config = OrderConfig(shuffle=self.shuffle, seed=self.seed + _SEED_STRIDE * self.plan.seed_keys[stream])
            order = self._orders[(stream, epoch)] = EpochOrder(self.sizes[stream], config, epoch)
            if len(self._orders) > 2 * len(self.sizes) + 2:
                self._orders.popitem(last=False)
        return order

    def lane_counts(self, samples_consumed: int) -> np.ndarray:
        """Samples of each global lane among the first `samples_consumed` positions."""
        counts = self.plan.counts_at(0, samples_consumed)
        return np.concatenate([lane_sample_counts(int(counts[s]), int(self.lanes[s]))
                               for s in np.flatnonzero(self.lanes > 0)])

    def _raw_place(self, stream: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(global lane, sample of the lane) of item k of each stream: raw stream s's item k is sample k // L of its
        lane k % L (as in a raw dataset of its own); -1 and 0 for built streams."""
        lanes = self.lanes[stream]
        safe = np.maximum(lanes, 1)
        return np.where(lanes > 0, self.lane_offsets[stream] + k % safe, -1), np.where(lanes > 0, k // safe, 0)

    def places_of_ids(self, sample_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(stream, global lane, sample of the lane) of each mixture sample id, the inverse of `step_rows`' ids
        (what `shardkit trace` reads again); for a built stream's id: lane -1 and its id within the stream."""
        ids = np.asarray(sample_ids, dtype=np.int64)
        stream = self.stream_of_ids(ids)
        raw = self.lanes[stream] > 0
        lane, index = self._raw_place(stream, np.where(raw, (ids - self.built_samples) // max(self.num_raw, 1), 0))
        return stream, lane, np.where(raw, index, ids - self.id_offsets[stream])

    def stream_of_ids(self, sample_ids: np.ndarray) -> np.ndarray:
        """The stream of each mixture sample id (what a batch's `stream` says)."""
        ids = np.asarray(sample_ids, dtype=np.int64)
        built = np.searchsorted(np.cumsum(self.samples), ids, side="right")
        raw_streams = np.flatnonzero(self.lanes > 0)
        raw = raw_streams[(ids - self.built_samples) % max(self.num_raw, 1)] if self.num_raw else built
        return np.where(ids >= self.built_samples, raw, built)
