"""The order of raw-text training: lanes, their epochs, and which global positions each rank reads. Pure
functions, no I/O.

The corpus's work units (`sources.raw.units.list_units`, a deterministic sequence) are dealt into a fixed
number of *lanes*, balanced by bytes (`deal_lanes`). Each lane is an independent stream: its units in a
per-epoch shuffled order (`lane_epoch_order`, seeded by seed, epoch and lane), each unit tokenized and packed
on its own. A lane that runs out of units for epoch e goes on with epoch e + 1 (a lane-epoch), so no rank ever
has to agree with another on where an epoch ends.

Global position i is sample `i // num_lanes` of lane `i % num_lanes`: positions go round the lanes, round r
holding sample r of every lane. A lane that runs dry (its units hold no accepted document, or every one was cut
as unreadable) is left out of the rounds from its last sample on: `dry` maps such a lane to the samples it holds
in all, and round r holds sample r of every lane with more than r samples (`dry_lane_rounds`). The positions
before a lane's last sample keep their places, so a lane found dry while a step is read changes only positions
from that step on (`sources.raw.dry_lanes` agrees on it over the ranks and keeps it in the state).

A job consumes positions in global steps of world_size x batch_size consecutive positions; inside a step the
positions are sorted by lane (stable) and cut into world_size equal slices (as built data is cut by canonical
partition, `shardkit.loaders.order.partition`), so a rank reads about num_lanes / world_size + 2 lanes and
tokenizes only those. The consumed positions are always a prefix, so `samples_consumed` alone says how many
samples of each lane were handed out (`lane_sample_counts`), whatever the world size, batch size or number of
workers that consumed them.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

NO_DRY_LANES: Mapping[int, int] = {}


def deal_lanes(unit_sizes: np.ndarray, num_lanes: int) -> np.ndarray:
    """The lane of each unit: the largest unit first to the lane holding the fewest bytes (ties: the lower
    lane), so lanes hold about the same bytes. Deterministic in `unit_sizes` and `num_lanes`.

    Raises:
        ValueError: `num_lanes` < 1 or more lanes than units (a lane without units never yields a sample).
    """
    sizes = np.asarray(unit_sizes, dtype=np.int64)
    if num_lanes < 1:
        raise ValueError(f"lanes must be >= 1, got {num_lanes}")
    if num_lanes > len(sizes):
        raise ValueError(f"lanes ({num_lanes}) exceeds the corpus's {len(sizes)} work units: give lanes <= "
                         f"{len(sizes)} or a smaller unit_bytes")
    lanes = np.empty(len(sizes), dtype=np.int64)
    heap = [(0, lane) for lane in range(num_lanes)]
    for unit in np.argsort(-sizes, kind="stable").tolist():
        held, lane = heapq.heappop(heap)
        lanes[unit] = lane
        heapq.heappush(heap, (held + int(sizes[unit]), lane))
    return lanes


def lane_units(lane_of_unit: np.ndarray, num_lanes: int) -> list[np.ndarray]:
    """Per lane, its units in corpus order."""
    order = np.argsort(lane_of_unit, kind="stable")
    cuts = np.searchsorted(lane_of_unit[order], np.arange(1, num_lanes))
    return np.split(order, cuts)


def lane_epoch_order(num_units: int, *, seed: int, epoch: int, lane: int, shuffle: bool = True) -> np.ndarray:
    """The order of a lane's `num_units` units in its `epoch` (indices into the lane's units)."""
    if not shuffle:
        return np.arange(num_units, dtype=np.int64)
    return np.random.default_rng([seed, epoch, lane, 0x1A7E]).permutation(num_units)


@dataclass(frozen=True)
class _Rounds:
    """Rounds from `first_round` on hold one sample of each of `live` (the lanes with more samples than that),
    starting at global position `first_position`, up to the next segment's first round."""

    first_round: int
    first_position: int
    live: np.ndarray


def dry_lane_rounds(num_lanes: int, dry: Mapping[int, int]) -> list[_Rounds]:
    """The rounds of positions as segments with the same live lanes: where a lane runs dry, a segment begins
    (the last one has no live lane when every lane runs dry)."""
    totals = np.full(num_lanes, np.iinfo(np.int64).max, dtype=np.int64)
    for lane, samples in dry.items():
        totals[lane] = samples
    segments, position, previous = [], 0, None
    for first in [0, *sorted({t for t in dry.values() if t > 0})]:
        if previous is not None:
            position += len(previous.live) * (first - previous.first_round)
        previous = _Rounds(first, position, np.flatnonzero(totals > first))
        segments.append(previous)
    return segments


def _segment_of(segments: list[_Rounds], positions: np.ndarray) -> np.ndarray:
    starts = np.array([s.first_position for s in segments], dtype=np.int64)
    return np.searchsorted(starts, positions, side="right") - 1


def lane_sample_counts(samples_consumed: int, num_lanes: int, dry: Mapping[int, int] = NO_DRY_LANES) -> np.ndarray:
    """Samples of each lane among the first `samples_consumed` global positions (lanes that ran dry: `dry`)."""
    if not dry:
        full, rest = divmod(samples_consumed, num_lanes)
        return full + (np.arange(num_lanes, dtype=np.int64) < rest)
    segments = dry_lane_rounds(num_lanes, dry)
    segment = segments[int(_segment_of(segments, np.array([samples_consumed]))[0])]
    counts = np.zeros(num_lanes, dtype=np.int64)
    for lane, samples in dry.items():
        counts[lane] = samples  # not live in this segment: all its samples come before it
    if len(segment.live):
        full, rest = divmod(samples_consumed - segment.first_position, len(segment.live))
        counts[segment.live] = segment.first_round + full
        counts[segment.live[:rest]] += 1
    return counts


def rank_step_positions(step: int, *, start: int, world_size: int, batch_size: int, rank: int,
                        num_lanes: int, dry: Mapping[int, int] = NO_DRY_LANES) -> np.ndarray:
    """The global positions `rank` reads at `step` (counted from `start` consumed positions), lane by lane.

    Concatenated in rank order, the slices of every rank are the step's positions sorted by lane (stable),
    whatever the world size: 1, 2 or 3 ranks with the same global batch read the same rows.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    global_batch = world_size * batch_size
    positions = start + step * global_batch + np.arange(global_batch, dtype=np.int64)
    by_lane = positions[np.argsort(position_lanes(positions, num_lanes, dry)[0], kind="stable")]
    return by_lane[rank * batch_size:(rank + 1) * batch_size]


def rank_step_lanes(step: int, *, start: int, world_size: int, batch_size: int, rank: int, num_lanes: int,
                    dry: Mapping[int, int] = NO_DRY_LANES) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`rank_step_positions` and their `position_lanes`: (positions, lanes, indices within the lanes).

    Without dry lanes a step's order by lane depends only on where the step begins modulo the lanes, so it is
    worked out once per such phase (a loader asks at every step, a per-step cost for cheap tokenizers)."""
    if dry:
        positions = rank_step_positions(step, start=start, world_size=world_size, batch_size=batch_size,
                                        rank=rank, num_lanes=num_lanes, dry=dry)
        return (positions, *position_lanes(positions, num_lanes, dry))
    first = start + step * world_size * batch_size
    offsets, lanes = _step_pattern(first % num_lanes, world_size=world_size, batch_size=batch_size, rank=rank,
                                   num_lanes=num_lanes)
    positions = offsets + first
    return positions, lanes, positions // num_lanes


@functools.lru_cache(maxsize=256)
def _step_pattern(phase: int, *, world_size: int, batch_size: int, rank: int, num_lanes: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The offsets from a step's first position of the positions `rank` reads, and their lanes (read-only), for
    a step whose first position is `phase` modulo `num_lanes`."""
    positions = rank_step_positions(0, start=phase, world_size=world_size, batch_size=batch_size, rank=rank,
                                    num_lanes=num_lanes)
    offsets, lanes = positions - phase, positions % num_lanes
    offsets.setflags(write=False)
    lanes.setflags(write=False)
    return offsets, lanes


def position_lanes(positions: np.ndarray, num_lanes: int, dry: Mapping[int, int] = NO_DRY_LANES
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(lane, sample index within the lane) of each global position (lanes that ran dry: `dry`).

    Raises:
        ValueError: a position past the last sample of every lane (all ran dry).
    """
    positions = np.asarray(positions, dtype=np.int64)
    if not dry:
        return positions % num_lanes, positions // num_lanes
    segments = dry_lane_rounds(num_lanes, dry)
    which = _segment_of(segments, positions)
    lanes, indices = np.empty_like(positions), np.empty_like(positions)
    for number in np.unique(which).tolist():
        segment, mine = segments[number], which == number
        if not len(segment.live):
            raise ValueError(f"raw text: all {num_lanes} lanes ran dry (their units hold no accepted document, or "
                             f"were cut as unreadable): no sample after the first {segment.first_position}; check "
                             "the inputs (the rejected documents are logged with their file)")
        offset = positions[mine] - segment.first_position
        lanes[mine] = segment.live[offset % len(segment.live)]
        indices[mine] = segment.first_round + offset // len(segment.live)
    return lanes, indices


def merge_cursors(*tables: dict[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
    """One cursor per lane from several ranks' (or workers') tables: a cursor is a tuple whose first entry is
    the lane's samples delivered, and the furthest one wins (the rank that read the lane's last sample)."""
    merged: dict[int, tuple[int, ...]] = {}
    for table in tables:
        for lane, cursor in table.items():
            lane = int(lane)
            if lane not in merged or cursor[0] > merged[lane][0]:
                merged[lane] = tuple(int(v) for v in cursor)
    return merged
