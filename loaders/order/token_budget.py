"""Token-budget batching for variable-length data: pure planning of one window of the global order.

The global order is consumed in *windows* of `window` consecutive positions (a fixed number, so the
windows do not depend on world size). For each window every rank computes the same plan from the
sample lengths alone:

1. `n` = batches per rank, starting at ceil(tokens / (world_size x max_tokens)).
2. Worst-fit decreasing: samples, longest first, each go to the least-filled of the
   `world_size x n` bins; if the longest remaining sample fits nowhere, `n` grows by one and the
   packing starts again. Every bin holds at most `max_tokens` tokens.
3. Bins, fullest first, are dealt to ranks in serpentine order (0..R-1, R-1..0, ...), so every rank
   gets exactly `n` bins and nearly the same number of tokens.

A bin left empty (only when a window has fewer samples than bins, e.g. its last window) is filled
with a repeat of the window's shortest sample so that no rank ever gets an empty batch; the repeat
keeps its real sample id. Resuming mid-window recomputes the plan and skips the consumed steps; an
elastic resume mid-window plans the window's *remaining* samples for the new world size.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WindowPlan:
    """Batches of one window: `batches[rank][k]` holds indices into the planned samples; -1 marks
    a repeat of the shortest sample (`filler`) that fills an otherwise empty batch."""

    batches: list[list[np.ndarray]]
    rank_tokens: np.ndarray
    repeats: int
    filler: int = -1

    @property
    def steps(self) -> int:
        return len(self.batches[0]) if self.batches else 0

    @property
    def imbalance(self) -> float:
        """max / mean - 1 of the tokens per rank (0 = perfectly balanced)."""
        mean = float(self.rank_tokens.mean()) if len(self.rank_tokens) else 0.0
        return float(self.rank_tokens.max()) / mean - 1 if mean > 0 else 0.0


def _pack(lengths: np.ndarray, order: np.ndarray, bins: int, max_tokens: int) -> list[list[int]] | None:
    heap = [(0, b) for b in range(bins)]
    content: list[list[int]] = [[] for _ in range(bins)]
    for item in order:
        load, b = heapq.heappop(heap)
        length = int(lengths[item])
        if load + length > max_tokens:
            return None  # the least-filled bin cannot take it: no bin can
        content[b].append(int(item))
        heapq.heappush(heap, (load + length, b))
    return content


def plan_window(lengths: Sequence[int] | np.ndarray, *, world_size: int, max_tokens: int) -> WindowPlan:
    """Equal-count, token-balanced batches of at most `max_tokens` tokens for one window."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if world_size < 1 or max_tokens < 1:
        raise ValueError(f"world_size ({world_size}) and max_tokens ({max_tokens}) must be >= 1")
    if len(lengths) == 0:
        return WindowPlan([[] for _ in range(world_size)], np.zeros(world_size, np.int64), 0, -1)
    too_long = np.flatnonzero(lengths > max_tokens)
    if len(too_long):
        raise ValueError(f"a sample of {int(lengths[too_long[0]])} tokens exceeds max_tokens={max_tokens}; "
                         "raise max_tokens to at least the dataset's max_sample_tokens")
    order = np.argsort(-lengths, kind="stable")
    per_rank = max(1, -(-int(lengths.sum()) // (world_size * max_tokens)))
    while (content := _pack(lengths, order, world_size * per_rank, max_tokens)) is None:
        per_rank += 1
    shortest = int(order[-1])
    repeats = 0
    for bin_items in content:
        if not bin_items:
            bin_items.append(-1)
            repeats += 1
    loads = np.array([int(lengths[[shortest if i < 0 else i for i in c]].sum()) for c in content])
    fullest_first = np.argsort(-loads, kind="stable")
    batches: list[list[np.ndarray]] = [[] for _ in range(world_size)]
    rank_tokens = np.zeros(world_size, dtype=np.int64)
    for j, b in enumerate(fullest_first):
        round_, pos = divmod(j, world_size)
        rank = pos if round_ % 2 == 0 else world_size - 1 - pos
        batches[rank].append(np.sort(np.array(content[b], dtype=np.int64)))
        rank_tokens[rank] += loads[b]
    return WindowPlan(batches, rank_tokens, repeats, shortest)


def plan_remaining(lengths: Sequence[int] | np.ndarray, segments: Sequence[tuple[int, int]], *, world_size: int,
                   max_tokens: int) -> tuple[WindowPlan, np.ndarray]:
    """Plan what is left of a window after `segments` of (world_size, steps) already consumed.

    Returns the plan for `world_size` and the window indices it covers (plan indices refer to
    positions in that array).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    remaining = np.arange(len(lengths), dtype=np.int64)
    for seg_world, seg_steps in segments:
        plan = plan_window(lengths[remaining], world_size=seg_world, max_tokens=max_tokens)
        if seg_steps > plan.steps:
            raise ValueError(f"loader state: {seg_steps} steps consumed in a window that has {plan.steps}")
        used = np.zeros(len(remaining), dtype=bool)
        for rank_batches in plan.batches:
            for batch in rank_batches[:seg_steps]:
                used[batch[batch >= 0]] = True
        remaining = remaining[~used]
    return plan_window(lengths[remaining], world_size=world_size, max_tokens=max_tokens), remaining
