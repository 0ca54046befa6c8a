"""The sample ids this rank (or DataLoader worker) reads, step by step, from an epoch's order.

`IterationPlan` says where an iteration starts and who reads it; `rank_step_ids` turns an `Order` and a
plan into this reader's sample ids [steps, batch], a chunk at a time. Both are pure: the positions come
from `shardkit.loaders.order.partition`, the ids from the order; nothing here reads a shard.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .epochs import Order
from .partition import partial_batch, rank_positions, steps_in_epoch, worker_step_chunks
from ..delivery.topology import Topology


@dataclass(frozen=True, kw_only=True)
class IterationPlan:
    """Where the next iteration starts and who reads it (set by the loader in the main process)."""

    epoch: int
    start: int
    batch_size: int
    topology: Topology
    num_partitions: int
    numpy_batches: bool = False  # the loader converts to tensors itself, after any process boundary
    bundle: int = 1  # with workers: consecutive batches sent as one list (one pipe message); the first as 1, 1, 2, ...
    segments: tuple[tuple[int, int], ...] = ()  # token-budget mode: (world_size, steps) done in the first window
    quarantine: tuple[tuple[int, int, int], ...] = ()  # (shard, epoch, position) left out (loaders.quarantine)
    steps: int | None = None  # read at most this many steps of the first epoch (on_corrupt="skip": one segment)


def steps_left(order: Order, *, start: int, plan: IterationPlan, policy: str) -> int:
    """Global steps of `order` from position `start` at the plan's global batch (after the partial-batch policy)."""
    return steps_in_epoch(order.num_positions, start=start, global_batch=plan.batch_size * plan.topology.world_size,
                          policy=policy)


def rank_step_ids(order: Order, *, start: int, plan: IterationPlan, policy: str, chunk_samples: int, worker: int = 0,
                  num_workers: int = 1, limit: int | None = None, skip: int = 0) -> Iterator[np.ndarray]:
    """Sample ids [steps, batch] of this rank's batches, about `chunk_samples` samples at a time, in order.

    Lazy: the steps are enumerated chunk by chunk, so the first chunk (also after a resume deep into the
    epoch) costs O(chunk), whatever the epoch's length. The smaller last step of partial_batches="partial"
    comes alone in its chunk.

    Args:
        order: the epoch's order (after every exclusion).
        start: positions of the order consumed before the first step.
        plan: batch size, topology and bundle of the reading processes.
        policy: partial_batches.
        chunk_samples: samples per chunk (amortises the per-chunk cost).
        worker, num_workers: this DataLoader worker and their number (steps are dealt round robin).
        limit: at most that many steps from `start` (on_corrupt="skip" reads one checked segment at a time).
        skip: leave out this worker's first that many steps (a standalone resume; nothing is read).
    """
    batch, world = plan.batch_size, plan.topology.world_size
    total = steps_left(order, start=start, plan=plan, policy=policy)
    last = partial_batch(order.num_positions, start=start, global_batch=batch * world, world_size=world, policy=policy)
    # The skipped steps are never enumerated: a worker resumed deep into an epoch starts there at once.
    for steps in worker_step_chunks(total if limit is None else min(total, limit), worker=worker,
                                    num_workers=num_workers, bundle=plan.bundle, chunk=max(1, chunk_samples // batch),
                                    skip=skip):
        if last is not None and steps[-1] == total - 1:  # the epoch's smaller last step
            if len(steps) > 1:
                yield _step_ids(order, start, steps[:-1], plan, batch)
            yield _step_ids(order, start, steps[-1:], plan, last)
        else:
            yield _step_ids(order, start, steps, plan, batch)


def _step_ids(order: Order, start: int, steps: np.ndarray, plan: IterationPlan, width: int) -> np.ndarray:
    """This rank's sample ids [steps, width] (width: samples per rank in these steps)."""
    topo = plan.topology
    positions = rank_positions(steps, start=start, num_positions=order.num_positions, world_size=topo.world_size,
                               batch_size=width, rank=topo.rank, partition_of=order.partition_of,
                               stride=plan.batch_size * topo.world_size)
    # Rows of a batch in sample-id order: runs per shard, copied in one pass (batching.py).
    ids = order.sample_ids(positions)
    ids.sort(axis=1)
    return ids
