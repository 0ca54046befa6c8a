"""The order of raw-text training: lanes, their epochs, and which global positions each rank reads. Pure
functions, no I/O.

The corpus's work units (`sources.raw.units.list_units`, a deterministic sequence) are dealt into a fixed
number of *lanes*, balanced by bytes (`deal_lanes`). Each lane is an independent stream: its units in a
per-epoch shuffled order (`lane_epoch_order`, seeded by seed, epoch and lane), each unit tokenized and packed
on its own. A lane that runs out of units for epoch e goes on with epoch e + 1 (a lane-epoch), so no rank ever
has to agree with another on where an epoch ends.

Global position i is sample `i // num_lanes` of lane `i % num_lanes`. A job consumes positions in global steps
of world_size x batch_size consecutive positions; inside a step the positions are sorted by lane (stable) and
cut into world_size equal slices (as built data is cut by canonical partition, `shardkit.loaders.order.partition`),
so a rank reads about num_lanes / world_size + 2 lanes and tokenizes only those. The consumed positions are
always a prefix, so `samples_consumed` alone says how many samples of each lane were handed out
(`lane_sample_counts`), whatever the world size, batch size or number of workers that consumed them.
"""

from __future__ import annotations

import heapq

import numpy as np


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


def lane_sample_counts(samples_consumed: int, num_lanes: int) -> np.ndarray:
    """Samples of each lane among the first `samples_consumed` global positions."""
    full, rest = divmod(samples_consumed, num_lanes)
    return full + (np.arange(num_lanes, dtype=np.int64) < rest)


def rank_step_positions(step: int, *, start: int, world_size: int, batch_size: int, rank: int,
                        num_lanes: int) -> np.ndarray:
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
    by_lane = positions[np.argsort(positions % num_lanes, kind="stable")]
    return by_lane[rank * batch_size:(rank + 1) * batch_size]


def position_lanes(positions: np.ndarray, num_lanes: int) -> tuple[np.ndarray, np.ndarray]:
    """(lane, sample index within the lane) of each global position."""
    positions = np.asarray(positions, dtype=np.int64)
    return positions % num_lanes, positions // num_lanes


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
