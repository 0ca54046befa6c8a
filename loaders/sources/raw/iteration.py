"""What one raw-text iteration starts from (`RawIteration`) and what one DataLoader worker read of a step
(`StepPart`): the values the raw source (`sources.raw.source`) and the loader's feed (`sources.raw.feed`) hand each other."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .dry_lanes import DryLane
from .unreadable import UnitCuts, Unreadable
from ...delivery.topology import Topology


@dataclass(frozen=True)
class RawIteration:
    """Where an iteration starts: consumed global positions, the lanes' cursors, the batch, the topology, the
    unreadable units' cuts in force and the lanes that ran dry (lane -> its samples in all: `order.lanes`); with
    persistent DataLoader workers, `worker_start` (`worker_start.WorkerStart`) tells them where each later
    iteration starts."""

    start: int
    batch_size: int
    topology: Topology
    cursors: dict[int, tuple[int, ...]] = field(default_factory=dict)
    cuts: UnitCuts = field(default_factory=UnitCuts)
    dry: dict[int, int] = field(default_factory=dict)
    worker_start: Any = None


@dataclass
class StepPart:
    """The rows of one step that one DataLoader worker read: their row numbers in the rank's batch, global
    positions, samples and lane epochs; the cursors of its lanes after them; the documents it rejected, the
    units it found unreadable and the lanes it found dry (`sources.raw.dry_lanes`)."""

    rows: np.ndarray
    positions: np.ndarray
    samples: list = field(default_factory=list)
    epochs: list = field(default_factory=list)
    cursors: np.ndarray | None = None
    rejected: Counter = field(default_factory=Counter)
    unreadable: list[Unreadable] = field(default_factory=list)
    dry: list[DryLane] = field(default_factory=list)
