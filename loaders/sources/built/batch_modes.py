"""Batch modes: fixed-size steps or token-budget steps, chosen once from the config (`batch_mode`).

A mode answers every question whose answer depends on how batches are cut: the batch size a loader
takes, the step source that counts what was handed out (`shardkit.loaders.order.steps`), how many steps are
left of an epoch, how far a saved position may run past the epoch's end, and the batches a reader reads.
The loader and the dataset hold the mode and never ask which one it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ...config import LoaderConfig
from ...delivery.frameworks import NEEDS_BATCH_SIZE
from ...order.epochs import Order
from ...order.partition import dropped_in_epoch, partial_batch, steps_in_epoch
from ...order.rank_steps import IterationPlan, rank_step_ids
from .reading import BatchReader
from ...state.loader_state import LoaderState
from ...order.steps import FixedSteps, Segments, StepSource, TokenBudgetSteps
from .token_batches import token_batches


class BatchMode(Protocol):
    """How batches are cut from an epoch's order."""

    def samples_per_rank(self, batch_size: Any) -> int: ...

    def standalone_batch_size(self, batch_size: int | None) -> int: ...

    def step_source(self) -> StepSource: ...

    def steps_left(self, num_positions: int, *, start: int, global_batch: int) -> int: ...

    def finished(self, consumed: int, num_positions: int, global_batch: int) -> bool: ...

    def check_fits(self, num_positions: int, *, batch_size: int, world_size: int) -> None: ...

    def overrun(self, saved: LoaderState) -> int: ...

    def epoch_summary(self, num_positions: int, *, global_batch: int, world_size: int) -> str | None: ...

    def batches(self, reader: BatchReader, order: Order, *, epoch: int, start: int, iteration: IterationPlan,
                worker: int, num_workers: int, segments: Segments = (), limit: int | None = None,
                skip: int = 0) -> Iterator[dict[str, np.ndarray]]: ...


@dataclass(frozen=True, kw_only=True)
class FixedBatches:
    """`batch_size` samples per rank per step (the last step per `partial_batches`)."""

    policy: str  # partial_batches
    chunk_samples: int

    def samples_per_rank(self, batch_size: Any) -> int:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        return batch_size

    def standalone_batch_size(self, batch_size: int | None) -> int:
        """Samples per rank of a dataset iterated on its own (its `batch_size`)."""
        if batch_size is None:
            raise ValueError(f"StreamingDataset iterated without a StreamingDataLoader {NEEDS_BATCH_SIZE}")
        return batch_size

    def step_source(self) -> StepSource:
        return FixedSteps()

    def steps_left(self, num_positions: int, *, start: int, global_batch: int) -> int:
        return steps_in_epoch(num_positions, start=start, global_batch=global_batch, policy=self.policy)

    def finished(self, consumed: int, num_positions: int, global_batch: int) -> bool:
        return self.steps_left(num_positions, start=consumed, global_batch=global_batch) == 0

    def check_fits(self, num_positions: int, *, batch_size: int, world_size: int) -> None:
        """Raise when an epoch holds no whole global batch (iteration would silently yield nothing).

        Raises:
            ValueError: naming batch_size, the world size and the samples per epoch.
        """
        if self.steps_left(num_positions, start=0, global_batch=batch_size * world_size) == 0:
            raise ValueError(f"batch_size={batch_size} x world_size={world_size} is larger than the "
                             f"{num_positions} samples of an epoch: no batch would be yielded with "
                             f"partial_batches={self.policy!r}; lower batch_size or use partial_batches='pad'")

    def overrun(self, saved: LoaderState) -> int:
        """Positions a saved position may lie past the epoch's end: the padded last step (pad, partial)."""
        return saved.global_batch_size if self.policy in ("pad", "partial") else 0

    def epoch_summary(self, num_positions: int, *, global_batch: int, world_size: int) -> str | None:
        """What an epoch of `num_positions` gives: batches per rank, what the policy drops or pads."""
        steps = self.steps_left(num_positions, start=0, global_batch=global_batch)
        left = dropped_in_epoch(num_positions, global_batch=global_batch, policy=self.policy, world_size=world_size)
        last = partial_batch(num_positions, start=0, global_batch=global_batch, world_size=world_size,
                             policy=self.policy)
        return (f"{steps} batches per rank, global batch {global_batch}, {'drops' if left >= 0 else 'pads'} "
                f"{abs(left)} positions (partial_batches={self.policy}"
                + (f": last batch {last} samples per rank)" if last is not None else ")"))

    def batches(self, reader: BatchReader, order: Order, *, epoch: int, start: int, iteration: IterationPlan,
                worker: int, num_workers: int, segments: Segments = (), limit: int | None = None,
                skip: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """This reader's batches of `order` from `start`, at most `limit` steps, its first `skip` left out."""
        steps = rank_step_ids(order, start=start, plan=iteration, policy=self.policy, chunk_samples=self.chunk_samples,
                              worker=worker, num_workers=num_workers, limit=limit, skip=skip)
        return reader.batches(steps, iteration.topology)


@dataclass(frozen=True, kw_only=True)
class TokenBudgetBatches:
    """Steps of at most `max_tokens` tokens per rank, planned per window of `token_window` positions."""

    max_tokens: int
    token_window: int

    def samples_per_rank(self, batch_size: Any) -> int:
        if batch_size is not None:
            raise ValueError("the dataset batches by max_tokens; pass batch_size=None")
        return 1

    def standalone_batch_size(self, batch_size: int | None) -> int:
        return batch_size or 1  # only its global batch is recorded: the windows decide the batches

    def step_source(self) -> StepSource:
        return TokenBudgetSteps(self.token_window)

    def steps_left(self, num_positions: int, *, start: int, global_batch: int) -> int:
        raise TypeError("len() is unknown in token-budget mode: batches per epoch depend on the sample lengths")

    def finished(self, consumed: int, num_positions: int, global_batch: int) -> bool:
        return consumed >= num_positions

    def check_fits(self, num_positions: int, *, batch_size: int, world_size: int) -> None:
        """Every window yields a batch per rank (an empty bin gets a filler): nothing to check."""

    def overrun(self, saved: LoaderState) -> int:
        """A window's last step accounts the whole window, which may pass the epoch's end."""
        return saved.token_window

    def epoch_summary(self, num_positions: int, *, global_batch: int, world_size: int) -> str | None:
        return None  # the steps depend on the lengths: token_batches logs each epoch once it is read

    def batches(self, reader: BatchReader, order: Order, *, epoch: int, start: int, iteration: IterationPlan,
                worker: int, num_workers: int, segments: Segments = (), limit: int | None = None,
                skip: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """This reader's token-budget batches of `order` from the window at `start` (`limit` does not apply:
        token-budget mode reads no checked segments)."""
        return token_batches(reader, order, epoch=epoch, start=start, segments=segments, plan=iteration,
                             worker=worker, num_workers=num_workers, skip=skip, max_tokens=self.max_tokens,
                             token_window=self.token_window)


BATCH_MODES = {"fixed": FixedBatches, "token_budget": TokenBudgetBatches}


def batch_mode(config: LoaderConfig) -> BatchMode:
    """The batch mode of a configuration: token budget when `max_tokens` is set, else fixed-size (chosen once)."""
    if config.max_tokens is not None:
        return BATCH_MODES["token_budget"](max_tokens=config.max_tokens, token_window=config.token_window)
    return BATCH_MODES["fixed"](policy=config.partial_batches, chunk_samples=config.chunk_samples)
