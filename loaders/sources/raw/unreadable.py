"""Unreadable raw-text units under `on_corrupt="skip"`: where a lane cuts a unit off, agreed by every rank.

A unit that cannot be read after the store's retries (a vanished file, a truncated or corrupt .gz / .zst, a
Parquet row group that fails to decode, a permission error) is *cut*: the lane delivers its samples before the
point where reading failed and goes on with its next unit. A cut is `UnitCut(unit, epoch, segment, within)`:
from lane epoch `epoch` on, the unit ends before sample `within` of its segment `segment` (0, 0: the whole
unit). Cuts are part of the loader state, so a resumed loader cuts the same units at the same points.

Why the ranks must agree. Two ranks that share a boundary lane in a step both read its units (and a rank that
reads a lane again after another rank did re-reads the units in between). A corrupt file fails the same way
for every reader, but a file that vanishes mid-run, a permission error on one node or a fault past the retry
budget fails for one reader only: if that rank alone skipped the unit, the lane's samples would be numbered
differently on two ranks and a sample would be repeated or lost. So each step's batch carries what its readers
found, the loader all-gathers it over the process group before handing the batch out (one small
`all_gather_object` per step, only with "skip" on several ranks), every rank takes the earliest cut of each
unit and logs it alike, and when some rank did not read the step with exactly those cuts, every rank reads it
again (its iteration restarts at the step, from its lanes' cursors) and the step is agreed again: all ranks
decide alike from the same gathered findings, so they gather the same number of times per step. A cut can only fall where the lane has not yet been
consumed: a unit that fails for a rank that re-reads it after other ranks already handed out samples past the
failure point (it vanished between the two reads) cannot be skipped without repeating or losing samples, and
every rank raises the same `OSError`; resuming from the last checkpoint then cuts it where that state stands.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardkit import metrics

from ...config import CORRUPT_POLICIES
from ...delivery.topology import process_group_ready

logger = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class UnitCut:
    """From lane epoch `epoch` on, unit `unit` ends before sample `within` of its segment `segment`."""

    unit: int
    epoch: int
    segment: int
    within: int


@dataclass(frozen=True)
class Unreadable:
    """What a lane reader found: the cut it made, its lane, the lane's samples before the cut, the unit's
    place (file and byte range / row group) and why."""

    cut: UnitCut
    lane: int
    lane_samples: int
    place: str
    reason: str


class UnitCuts:
    """The cuts in force (small and picklable): a lane reader asks where a unit ends in a lane epoch."""

    def __init__(self, cuts: tuple[UnitCut, ...] = ()):
        self.cuts = tuple(sorted(set(cuts)))
        self._by_unit: dict[int, list[UnitCut]] = {}
        for cut in self.cuts:
            self._by_unit.setdefault(cut.unit, []).append(cut)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UnitCuts) and self.cuts == other.cuts

    def __len__(self) -> int:
        return len(self.cuts)

    def adding(self, cuts: list[UnitCut] | tuple[UnitCut, ...]) -> UnitCuts:
        return UnitCuts((*self.cuts, *cuts))

    def end(self, unit: int, epoch: int) -> tuple[int, int] | None:
        """(segment, within) where `unit` ends in lane epoch `epoch`, or None when it is read whole."""
        ends = [(c.segment, c.within) for c in self._by_unit.get(unit, ()) if c.epoch <= epoch]
        return min(ends) if ends else None

    def rows(self) -> list[list[int]]:
        """The loader state's `raw_text.unreadable`: [unit, epoch, segment, within] per cut."""
        return [[c.unit, c.epoch, c.segment, c.within] for c in self.cuts]

    @classmethod
    def from_rows(cls, rows: Any) -> UnitCuts:
        """The inverse of `rows()`.

        Raises:
            ValueError: the rows are not lists of four non-negative integers.
        """
        try:
            cuts = tuple(UnitCut(*(int(v) for v in row)) for row in rows)
        except (TypeError, ValueError):
            cuts = None
        if cuts is None or any(min(c.unit, c.epoch, c.segment, c.within) < 0 for c in cuts):
            raise ValueError("loader state: raw_text.unreadable must be a list of [unit, epoch, segment, within]")
        return cls(cuts)


def check_policy(on_corrupt: str, skip_samples: Any, quarantine_list: Any) -> None:
    """Refuse what raw text cannot honour, naming the option.

    Raises:
        ValueError: an unknown `on_corrupt`, or `skip_samples` / `quarantine_list` (see the messages for why).
    """
    if on_corrupt not in CORRUPT_POLICIES:
        raise ValueError(f"on_corrupt must be one of {CORRUPT_POLICIES}, got {on_corrupt!r}")
    if skip_samples:
        raise ValueError("skip_samples is not supported for raw text: a raw sample id is a position of an endless "
                         "stream that never comes back (each lane epoch packs other units), so 'leave it out of "
                         "every epoch' has no meaning; to step past bad data after a resume, skip training steps "
                         "instead")
    if quarantine_list is not None:
        raise ValueError("quarantine_list names shards of a built dataset; raw text has no shards. Use "
                         "on_corrupt='skip' to skip unreadable input units, or remove the bad files from the inputs")


def agree(found: Any, *, world_size: int, group: Any) -> list[Any]:
    """Every rank's findings of one step (`found`: this rank's, picklable), rank by rank, the same on every rank.

    Raises:
        ValueError: several ranks without an initialised process group.
    """
    if world_size == 1:
        return [found]
    import torch.distributed as dist

    if not process_group_ready():
        raise ValueError("on_corrupt='skip' on several ranks needs an initialised torch.distributed process group: "
                         "the ranks must agree on what to skip")
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, found, group=group)
    return everyone


def settle(agreed: list[list[Unreadable]], *, lane_counts: np.ndarray) -> tuple[list[Unreadable], bool]:
    """(the step's cuts, the earliest of each unit and lane epoch, in unit order; whether the ranks must read the
    step again: some rank read it with other cuts) from every rank's findings (`agree`).

    Raises:
        OSError: a cut falls before what the job consumed of its lane (`lane_counts`: each lane's samples handed
            out before the step): the unit failed for a reader after samples past the failure were handed out.
    """
    earliest: dict[tuple[int, int], Unreadable] = {}
    for item in (item for part in agreed for item in part):  # in rank order: of equal cuts, the lowest rank's reason
        key = (item.cut.unit, item.cut.epoch)
        if key not in earliest or item.cut < earliest[key].cut:
            earliest[key] = item
    cuts = [earliest[key] for key in sorted(earliest)]
    for item in cuts:
        if item.lane_samples < int(lane_counts[item.lane]):
            raise OSError(f"{item.place}: cannot be read ({item.reason}) by a reader of lane {item.lane} after "
                          f"{int(lane_counts[item.lane])} of its samples were handed out, {item.lane_samples} of "
                          "them before this unit's failure point (did the file vanish or change during the run?): "
                          "skipping it now would repeat or lose samples; resume from the last checkpoint (the "
                          "loader then skips it from there)")
    chosen = {c.cut for c in cuts}
    return cuts, any({f.cut for f in part} != chosen for part in agreed)


def log_skipped(cuts: list[Unreadable], url_of_unit: Any) -> None:
    """Log and count agreed cuts (every rank does, alike)."""
    for item in cuts:
        where = "" if item.cut == UnitCut(item.cut.unit, item.cut.epoch, 0, 0) else (
            f" from its segment {item.cut.segment}, sample {item.cut.within} on")
        logger.warning("skipped an unreadable unit, %s%s (lane %d, lane epoch %d on): %s; the lane goes on with "
                       "its next unit on every rank (on_corrupt='skip')", item.place, where, item.lane,
                       item.cut.epoch, item.reason)
        metrics.inc("shardkit_loader_skipped_units_total", stream=metrics.stream_label(url_of_unit(item.cut.unit)))
