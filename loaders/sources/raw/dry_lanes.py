"""Lanes that run dry: left out of the order from their last sample on, alike on every rank and after a resume.

A lane runs dry when a whole lane epoch of its units holds no accepted document: every record rejected, or
every unit cut as unreadable under `on_corrupt="skip"` (one damaged `.jsonl.gz` is one unit: a lane of its own
when lanes are few). That is known only by reading the lane, and only the ranks whose slices reach it read it,
while every rank's slice depends on it (`order.lanes`: a dry lane leaves the rounds of positions from its last
sample on). So a reader that finds its lane dry reports it with the step (`DryLane`: the lane and the samples it
holds in all, the same for every reader that reads it with the same cuts), the loader gathers the step's findings
over the ranks before it hands the step out (with the unreadable units' cuts, in the same collective), every rank
adds the lanes to its order alike, and every rank reads the step again with them; the state keeps them
(`raw_text.dry_lanes`: [lane, samples] rows), so a resume on any number of ranks orders positions alike.

Which steps are agreed: every step under "skip" (a unit may fail at any time, and a lane with it); under "raise",
with one rank always (no collective), and on several ranks the steps of round 0 (each lane's first sample), where a
lane whose units hold no accepted document is found: with nothing cut, a lane that gave one sample gives one in
every lane epoch. A lane found dry elsewhere (a state that cut units, resumed under "raise"), or on several ranks
without a process group (an explicit rank and world size: nothing to agree over), stops the loader with the
lane's error (`sources.raw.corpus.LaneRanDry`), as does a lane of a mixture.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DryLane:
    """What a lane reader found: lane `lane` holds `samples` samples in all; `inputs` are the lane's files and
    `message` its error where the loader cannot leave it out."""

    lane: int
    samples: int
    inputs: str
    message: str


def round_zero_size(num_lanes: int, dry: Mapping[int, int]) -> int:
    """Positions of round 0 (each lane's first sample): the lanes that hold a sample."""
    return num_lanes - sum(1 for samples in dry.values() if samples == 0)


def agrees_on_dry_lanes(*, skipping: bool, world_size: int, grouped: bool, step_start: int, num_lanes: int,
                        dry: Mapping[int, int]) -> bool:
    """Whether the step that starts at `step_start` is agreed over the ranks (see the module docstring): the same
    answer on every rank, from what every rank knows."""
    if skipping or world_size == 1:
        return True
    return grouped and step_start < round_zero_size(num_lanes, dry)


def newly_dry(everyone: list[list[DryLane]], dry: Mapping[int, int]) -> list[DryLane]:
    """The lanes every rank's findings of a step (`everyone`, rank by rank) add to `dry`, by lane: of two
    findings of one lane (never different when read with the same cuts), the fewer samples."""
    found: dict[int, DryLane] = {}
    for item in (item for part in everyone for item in part):
        if item.lane not in dry and (item.lane not in found or item.samples < found[item.lane].samples):
            found[item.lane] = item
    return [found[lane] for lane in sorted(found)]


def log_dry(lanes: list[DryLane], *, num_lanes: int, dry: Mapping[int, int]) -> None:
    """Log lanes just added to the order's dry lanes (`dry`, with them); every rank does, alike."""
    for item in lanes:
        logger.warning("raw text: lane %d of %d holds no accepted document after its first %d samples (its inputs: "
                       "%s); the order leaves it out from there on, on every rank (%d lanes go on)", item.lane,
                       num_lanes, item.samples, item.inputs, num_lanes - len(dry))


def dry_rows(dry: Mapping[int, int]) -> list[list[int]]:
    """The state's `raw_text.dry_lanes`: [lane, samples] per dry lane, by lane."""
    return [[lane, samples] for lane, samples in sorted(dry.items())]


def dry_from_rows(rows: Any, num_lanes: int) -> dict[int, int]:
    """The inverse of `dry_rows`, checked against the corpus's lanes.

    Raises:
        ValueError: not rows of [lane, samples] with a lane of this corpus (a damaged or edited state).
    """
    try:
        dry = {int(lane): int(samples) for lane, samples in rows}
    except (TypeError, ValueError):
        dry = None
    if dry is None or any(not 0 <= lane < num_lanes or samples < 0 for lane, samples in dry.items()) \
            or len(dry) != len(list(rows)):
        raise ValueError(f"cannot resume: the loader state's raw_text.dry_lanes must be a list of [lane, samples] "
                         f"with a lane in [0, {num_lanes}) each once, got {rows!r}"[:300])
    return dry
