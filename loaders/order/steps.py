"""Step sources: how far a run is in an epoch's global order, each owning its own resume fields.

A `StreamingDataLoader` counts what it handed to the training loop through one of two step sources,
chosen once from the config:

- `FixedSteps`: every step takes `world_size x batch_size` positions (the last one fewer under
  partial_batches="partial"); the state is the positions consumed.
- `TokenBudgetSteps`: steps are planned per window of `token_window` positions from the samples'
  lengths (`shardkit.loaders.order.token_budget`); the state is the window's first position and, mid-window,
  the steps each world size already took of it (`window_segments`), so an elastic resume plans only
  the window's remaining samples.

Both are read-side stages (`shardkit.loaders.state.loader_state.Stage`): `state()` gives their fields of `LoaderState`,
`restore(saved)` takes them back. The readers (the dataset, in the workers) get the same fields through
the iteration plan; `TokenBudgetSteps.resume_point` is the one place that decides where a resumed window
continues. Which of the two a loader uses is its batch mode's choice (`shardkit.loaders.sources.built.batch_modes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..state.loader_state import LoaderState

Segments = tuple[tuple[int, int], ...]  # (world_size, steps) taken of the current window, in order


class StepSource(Protocol):
    """Where a run stands in the current epoch, advanced batch by batch."""

    consumed: int
    segments: Segments

    def advance(self, rows: int, progress: np.ndarray | None, world_size: int) -> None: ...

    def reset(self) -> None: ...

    def state(self) -> dict[str, Any]: ...

    def restore(self, saved: LoaderState) -> None: ...


@dataclass
class FixedSteps:
    """Fixed-size steps: `consumed` positions of the epoch's global order handed out (all ranks)."""

    consumed: int = 0
    segments: Segments = ()  # always empty: the position alone says where the run stands

    def advance(self, rows: int, progress: np.ndarray | None, world_size: int) -> None:
        # every rank's batch has this size ("partial": the last step is smaller on every rank alike)
        self.consumed += rows * world_size

    def reset(self) -> None:
        self.consumed = 0

    def state(self) -> dict[str, Any]:
        return {"samples_consumed": self.consumed, "window_segments": ()}

    def restore(self, saved: LoaderState) -> None:
        self.consumed = saved.samples_consumed


@dataclass
class TokenBudgetSteps:
    """Token-budget steps: the current window's first position, and the steps taken of it per world size."""

    token_window: int
    consumed: int = 0
    segments: Segments = ()

    def advance(self, rows: int, progress: np.ndarray | None, world_size: int) -> None:
        """Account a batch from its progress marks (window start, steps done of it, window finished)."""
        window_start, steps_done, window_finished = (int(x) for x in progress)
        if window_finished:
            self.consumed, self.segments = window_start + self.token_window, ()
            return
        prior = self.segments if window_start == self.consumed else ()
        if prior and prior[-1][0] == world_size:
            prior = prior[:-1]
        self.consumed, self.segments = window_start, (*prior, (world_size, steps_done))

    def reset(self) -> None:
        self.consumed, self.segments = 0, ()

    def state(self) -> dict[str, Any]:
        return {"samples_consumed": self.consumed, "window_segments": self.segments}

    def restore(self, saved: LoaderState) -> None:
        self.consumed, self.segments = saved.samples_consumed, saved.window_segments

    @staticmethod
    def resume_point(segments: Segments, world_size: int) -> tuple[Segments, int]:
        """(segments planned by other world sizes, steps of this world size's plan already taken) of a
        window resumed with `segments`: the same world continues its own plan, another plans the rest."""
        if segments and segments[-1][0] == world_size:
            return segments[:-1], segments[-1][1]
        return segments, 0

