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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardkit.lineage import segments_of

from ...source import Provenance, SampleProvenance
from ...state.envelope import decode
from .corpus import CURSOR_FIELDS, RejectionLog
from .dry_lanes import dry_from_rows
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


def lane_provenance(source: Any, places: dict[int, LanePlace], raw_text: dict[str, Any] | None) -> Provenance:
    """Each sample id of `places` made again from its lane of `source` (a `RawTextSource`), each lane read once:
    from its cursor in a loader state's `raw_text` (`saved_raw_text`) where that stands before the samples, else
    from its start. `reread` counts the lane samples packed on the way."""
    cursors, cuts = {}, UnitCuts()
    if raw_text is not None:
        cursors, cuts = saved_cursors(raw_text), UnitCuts.from_rows(raw_text.get("unreadable", ()))
    wanted: dict[int, set[int]] = {}
    for place in places.values():
        wanted.setdefault(place.lane, set()).add(place.index)
    made, reread = {}, 0
    for lane, indexes in sorted(wanted.items()):
        cursor = cursors.get(lane, (0,) * CURSOR_FIELDS)
        if cursor[0] > min(indexes):
            cursor = (0,) * CURSOR_FIELDS
        stream = source.lane_stream(lane, _Unlogged(), cursor, cuts)
        for index in sorted(indexes):
            made[(lane, index)] = (*stream.take(index), stream.corpus)
        reread += stream.cursor.samples - cursor[0]
    samples = {}
    for sample_id, place in places.items():
        sample, epoch, corpus = made[(place.lane, place.index)]
        samples[sample_id] = SampleProvenance(
            place={"dataset": place.url, "lane": place.lane, "lane_sample": place.index, "lane_epoch": epoch},
            documents=raw_segments(sample, corpus), tokens=sample.tokens)
    return Provenance(samples=samples, reread=reread)


def raw_segments(sample: Any, corpus: Any) -> list[dict[str, Any]]:
    """A raw sample's document segments as `shardkit.lineage.Segment` fields: tokens [start, end) of document
    `doc` (line, row or paragraph) of input file `source_name` (source -1: padding)."""
    return [dataclasses.asdict(s) for s in segments_of(sample, [file.url for file in corpus.files])]
