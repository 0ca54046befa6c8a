"""The provenance of raw-text samples (`Source.provenance`): no shard holds them, so each is made again.

A sample id is a position of the raw dataset (or, in a mixture, an item of a raw stream), and the loader made it by
reading one lane's units in that lane epoch's order and packing their documents. So each lane is read again up to
the samples asked for: the same documents, tokenized and packed again. The reading starts where a loader state
saved before the samples left each lane (a cursor per lane, and the unreadable units it cut), so finding a sample
costs at most the text the loader read between that state and it; without a state, each lane is read from its
start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardkit.lineage import segments_of

from ...source import Provenance, SampleProvenance
from ...state.envelope import decode
from ...order.lanes import position_lanes
from .corpus import CURSOR_FIELDS, LaneRanDry, RejectionLog
from .dry_lanes import DryLane, agrees_on_dry_lanes, dry_from_rows, newly_dry
from .feed import saved_cursors
from .unreadable import UnitCuts


@dataclass(frozen=True)
class LanePlace:
    """Where a raw sample comes from: raw text `url`'s (global) lane `lane`, its sample `index`."""

    url: str
    lane: int
    index: int


class _Unlogged(RejectionLog):
    """Rejected documents were logged when the loader first read them: reading them again does not log them."""

    def log(self, url, where, reason) -> None:
        pass


def checked_ids(sample_ids: Sequence[int]) -> np.ndarray:
    """The ids as an array.

    Raises:
        IndexError: a negative id, naming it.
    """
    ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)
    if ids.size and int(ids.min()) < 0:
        raise IndexError(f"sample id {int(ids.min())} is negative")
    return ids


def saved_raw_text(state: dict[str, Any] | None) -> dict[str, Any] | None:
    """The `raw_text` part of a loader `state` (checked), or None without a state."""
    return None if state is None else decode(state)["raw_text"]


def saved_dry_lanes(raw_text: dict[str, Any] | None, num_lanes: int) -> dict[int, int]:
    """The lanes a loader state's `raw_text` knows ran dry (lane -> its samples in all); none without a state."""
    return {} if raw_text is None else dry_from_rows(raw_text.get("dry_lanes", ()), num_lanes)


class LaneReads:
    """Lanes of `source` (a `RawTextSource` or a mixture's) read again: each lane's stream starts at its cursor in
    a loader state's `raw_text` (`saved_raw_text`), or at the lane's start where one of `places` (the samples to
    be taken first) lies before that cursor or the state has none; the state's cuts in force."""

    def __init__(self, source: Any, raw_text: dict[str, Any] | None, places: Iterable[LanePlace] = ()):
        self.cursors, self.cuts = {}, UnitCuts()
        if raw_text is not None:
            self.cursors, self.cuts = saved_cursors(raw_text), UnitCuts.from_rows(raw_text.get("unreadable", ()))
        self.source, self.earliest = source, {}
        for place in places:
            self.earliest[place.lane] = min(place.index, self.earliest.get(place.lane, place.index))
        self.streams: dict[int, Any] = {}
        self.started: dict[int, int] = {}  # lane -> the sample its stream started at

    def take(self, lane: int, index: int) -> tuple[Any, int, Any]:
        """(sample `index` of `lane`, its lane epoch, the lane's corpus); a lane's indexes asked in increasing order.

        Raises:
            LaneRanDry: the lane has no sample `index`.
        """
        stream = self.streams.get(lane)
        if stream is None:
            cursor = self.cursors.get(lane, (0,) * CURSOR_FIELDS)
            if cursor[0] > self.earliest.get(lane, cursor[0]):
                cursor = (0,) * CURSOR_FIELDS
            stream = self.streams[lane] = self.source.lane_stream(lane, _Unlogged(), cursor, self.cuts)
            self.started[lane] = cursor[0]
        return (*stream.take(index), stream.corpus)

    def made(self, places: dict[int, LanePlace]) -> dict[int, tuple[LanePlace, Any, int, Any]]:
        """Sample id -> (its place, the sample, its lane epoch, its corpus) of each of `places`, taken lane by lane."""
        taken = {(lane, index): self.take(lane, index)
                 for lane, index in sorted({(place.lane, place.index) for place in places.values()})}
        return {i: (place, *taken[(place.lane, place.index)]) for i, place in places.items()}

    @property
    def reread(self) -> int:
        """The lane samples packed so far."""
        return sum(stream.cursor.samples - self.started[lane] for lane, stream in self.streams.items())


def lane_provenance(source: Any, places: dict[int, LanePlace], raw_text: dict[str, Any] | None) -> Provenance:
    """Each sample id of `places` made again from its lane of `source` (a `RawTextSource`), each lane read once
    (`LaneReads`). `reread` counts the lane samples packed on the way."""
    reads = LaneReads(source, raw_text, places.values())
    return provenance_of(reads.made(places), reads.reread)


def position_provenance(source: Any, sample_ids: Sequence[int], state: dict[str, Any] | None) -> Provenance:
    """The provenance of a `RawTextSource`'s sample ids (its global positions), read again from a loader `state`
    (or from the lanes' starts without one).

    A position's lane depends on the lanes that ran dry before it (`order.lanes.position_lanes`), and a lane that
    ran dry after the state was saved is not in it. So the ids before the state's position map through the state's
    dry lanes, and the order is replayed from that position up to the last id step by step as the loader read it
    (`_Replay`): each step's positions mapped through the dry lanes known, their lanes read, a lane found dry
    added (`dry_lanes.newly_dry`) and the step mapped again.

    Raises:
        IndexError: a negative id.
        ValueError: a lane ran dry where the run's ranks could not agree on leaving it out (it stopped there), or
            every lane ran dry before an id.
    """
    ids, saved = checked_ids(sample_ids), None if state is None else decode(state)
    raw_text, start = (None, 0) if saved is None else (saved["raw_text"], int(saved["samples_consumed"]))
    dry = saved_dry_lanes(raw_text, source.num_lanes)
    url = ",".join(source.inputs)
    before = ids[ids < start]
    lanes, indexes = position_lanes(before, source.num_lanes, dry)
    places = {i: LanePlace(url, lane, index) for i, lane, index in zip(before.tolist(), lanes.tolist(),
                                                                       indexes.tolist())}
    reads = LaneReads(source, raw_text, places.values())  # the ids before the state first: lanes start before it
    made = reads.made(places)
    later = set(ids[ids >= start].tolist())
    if later:
        replay = _Replay(source=source, reads=reads, url=url, dry=dry, skipping=source.on_corrupt == "skip",
                         world_size=1 if saved is None else int(saved["world_size"]))
        # Without a state, one position a step: reading the samples costs far more than mapping them.
        step = 1 if saved is None else max(1, int(saved["global_batch_size"]))
        made.update(replay.samples(later, start=start, step=step))
    return provenance_of(made, reads.reread)


@dataclass
class _Replay:
    """The loader's order replayed by one reader: `dry` grows as the lanes `reads` reads run dry."""

    source: Any
    reads: LaneReads
    url: str
    dry: dict[int, int]
    skipping: bool
    world_size: int

    def samples(self, wanted: set[int], *, start: int, step: int) -> dict[int, tuple[LanePlace, Any, int, Any]]:
        """Position -> (its place, sample, lane epoch, corpus) of each of `wanted` (positions from `start` on),
        the steps of `step` positions from `start` replayed up to the last of them."""
        made, last = {}, max(wanted)
        for step_start in range(start, last + 1, step):
            positions = np.arange(step_start, min(step_start + step, last + 1), dtype=np.int64)
            keep = not wanted.isdisjoint(positions.tolist())
            lanes, indexes, taken = self._step(positions, keep=keep)
            for position, lane, index in zip(positions.tolist(), lanes.tolist(), indexes.tolist()):
                if position in wanted:
                    made[position] = (LanePlace(self.url, lane, index), *taken[(lane, index)])
        return made

    def _step(self, positions: np.ndarray, *, keep: bool) -> tuple[np.ndarray, np.ndarray, dict[tuple[int, int], Any]]:
        """(lane, index of each of a step's `positions`; the samples read, `keep` or else None) once the step's
        lanes that ran dry are known, as the loader agreed on them: a lane found dry joins `dry` and the step is
        mapped again (the positions before the lane's last sample keep their places, the later ones go to other
        lanes' later samples: what was read stays read, kept for a position that now maps to it)."""
        taken: dict[tuple[int, int], Any] = {}
        while True:
            lanes, indexes = position_lanes(positions, self.source.num_lanes, self.dry)
            found: list[DryLane] = []
            for lane, index in sorted(set(zip(lanes.tolist(), indexes.tolist()))):
                if (lane, index) in taken or any(item.lane == lane for item in found):
                    continue
                try:
                    sample = self.reads.take(lane, index)
                    taken[(lane, index)] = sample if keep else None
                except LaneRanDry as err:
                    found.append(DryLane(err.lane, err.samples, err.inputs, str(err)))
            if not found:
                return lanes, indexes, taken
            self._agreed(found, step_start=int(positions[0]))
            self.dry.update((item.lane, item.samples) for item in newly_dry([found], self.dry))

    def _agreed(self, found: list[DryLane], *, step_start: int) -> None:
        """Raise where the run's loader could not leave the lanes `found` out (it stopped with their error).
        A state with several ranks was gathered over a process group, so the run had one."""
        if not agrees_on_dry_lanes(skipping=self.skipping, world_size=self.world_size, grouped=True,
                                   step_start=step_start, num_lanes=self.source.num_lanes, dry=self.dry):
            raise ValueError(f"cannot make sample {step_start} and later again: {found[0].message}, and the "
                             f"run's {self.world_size} ranks could not agree on leaving it out there under "
                             "on_corrupt='raise' (the run stopped at that step)")


def provenance_of(made: dict[int, tuple[LanePlace, Any, int, Any]], reread: int) -> Provenance:
    """The `Provenance` of samples made again: sample id -> (its place, the sample, its lane epoch, its corpus)."""
    samples = {}
    for sample_id, (place, sample, epoch, corpus) in made.items():
        samples[sample_id] = SampleProvenance(
            place={"dataset": place.url, "lane": place.lane, "lane_sample": place.index, "lane_epoch": epoch},
            documents=raw_segments(sample, corpus), tokens=sample.tokens)
    return Provenance(samples=samples, reread=reread)


def raw_segments(sample: Any, corpus: Any) -> list[dict[str, Any]]:
    """A raw sample's document segments as `shardkit.lineage.Segment` fields: tokens [start, end) of document
    `doc` (line, row or paragraph) of input file `source_name` (source -1: padding)."""
    return [dataclasses.asdict(s) for s in segments_of(sample, [file.url for file in corpus.files])]
