"""Token-budget batches: each window of the epoch's order planned from the samples' lengths, then read.

The pure planning is `shardkit.loaders.order.token_budget` (one window, every rank the same plan); where a
resumed window continues is `TokenBudgetSteps.resume_point`; the reading is the `BatchReader`'s. This
module only walks the windows from the resume point and deals the planned steps to this DataLoader
worker. Every batch carries its progress marks under `PROGRESS_KEY` (window start, steps done of the
window, window finished) so that the data loader's step source can account it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np

from ...delivery.closing import closed_at_exit
from ...order.epochs import Order
from ...order.partition import worker_of_step
from ...order.rank_steps import IterationPlan
from .reading import BatchReader
from ...order.steps import Segments, TokenBudgetSteps
from ...order.token_budget import plan_remaining

logger = logging.getLogger(__name__)

PROGRESS_KEY = "_progress"  # token-budget batches carry (window start, steps done, window finished)


@closed_at_exit
def token_batches(reader: BatchReader, order: Order, *, epoch: int, start: int, segments: Segments,
                  plan: IterationPlan, worker: int, num_workers: int, max_tokens: int, token_window: int,
                  skip: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """This worker's token-budget batches of `order` from the window at position `start`.

    Args:
        reader: reads the samples of a window through the node-local caches.
        order: the epoch's order (after every exclusion).
        epoch: the epoch (logged).
        start: first position of the first window.
        segments: (world_size, steps) already taken of the first window (a resume).
        plan: topology and bundle of the reading processes.
        worker, num_workers: this DataLoader worker and their number.
        max_tokens, token_window: tokens per batch, positions planned together.
        skip: leave out this worker's first that many batches (a standalone resume: planned, not read).
    """
    topo, total = plan.topology, order.num_positions
    step = 0  # steps of this iteration, dealt round robin to the DataLoader workers
    held: dict[int, Any] = {}
    rank_tokens, repeats = np.zeros(topo.world_size, dtype=np.int64), 0
    try:
        for window_start in range(start, total, token_window):
            ids = order.sample_ids(np.arange(window_start, min(window_start + token_window, total)))
            needed = reader.shards_in_order(ids)
            for index in [i for i in held if i not in set(needed)]:
                held.pop(index).close()
            reader.hold(needed, held)
            reader.ensure(ids, held)
            prior, done = TokenBudgetSteps.resume_point(segments if window_start == start else (), topo.world_size)
            window_plan, covered = plan_remaining(reader.lengths(ids, held), prior, world_size=topo.world_size,
                                                  max_tokens=max_tokens)
            mine = window_plan.batches[topo.rank]
            rank_tokens += window_plan.rank_tokens
            repeats += window_plan.repeats
            for k in range(done, window_plan.steps):
                if worker_of_step(step, num_workers=num_workers, bundle=plan.bundle) == worker:
                    if skip:
                        skip -= 1
                    else:
                        rows = np.where(mine[k] < 0, window_plan.filler, mine[k])
                        batch = reader.gather_rows(ids[covered[rows]], held)
                        batch[PROGRESS_KEY] = np.array([window_start, k + 1, k + 1 == window_plan.steps],
                                                       dtype=np.int64)
                        yield batch
                step += 1
        if worker == 0 and rank_tokens.sum():
            logger.info("epoch %d (token budget %d): %d steps, token imbalance across ranks %.2f%% "
                        "(max / mean - 1), %d repeated samples filled empty batches", epoch, max_tokens,
                        step, 100 * (rank_tokens.max() / rank_tokens.mean() - 1), repeats)
    finally:
        for handle in held.values():
            handle.close()
