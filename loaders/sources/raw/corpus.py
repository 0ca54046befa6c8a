"""Reading raw text lane by lane: the corpus's units, a unit reader, and one lane's stream of packed samples.

`RawCorpus` lists the inputs' work units without reading the corpus (`sources.raw.units.list_units`: byte ranges,
Parquet row groups, streamed compressed files) and deals them into lanes (`order.lanes.deal_lanes`). A
`LaneStream` turns one lane into samples: its units in the lane epoch's order, each unit's segments (one, or
the build's ~unit_bytes pieces of a streamed file) packed on their own by the build's packer
(`shardkit.text.packing.make_packer`, finished at the segment's end), its documents tokenized a few at a time as
samples are asked for (`sources.raw.segment_samples`), so a lane's first sample needs its first few documents.
A lane's position is a small cursor: (samples delivered, lane epoch, unit in the epoch's order, segment of that
unit, samples of that segment delivered, and where the next sample begins: record of the segment and token of
its document). Resuming from a cursor re-reads the segment and tokenizes from that document on (concat, none; bestfit from
the segment's start); a streamed file is decompressed up to the segment, not tokenized. No packer buffer is ever
saved.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from shardkit.formats import Sample
from shardkit.manifest import token_dtype_for_vocab
from shardkit.text.documents import DocumentSettings, cached_tokenizer, reason_category
from shardkit.text.inputs import InputChangedError, InputFile, WorkUnit, expand_inputs
from shardkit.text.packing import Packer, make_packer
from shardkit.text.recipe import TextRecipe, check_count
from shardkit.wording import setting
from shardkit.text.tokenizers import with_special_ids

from ...order.lanes import deal_lanes, lane_epoch_order, lane_units
from .segment_samples import FIRST_CHARS, SegmentSamples
from .units import RANGE, list_units, read_segments, record_place, unit_place
from .unreadable import UnitCut, UnitCuts, Unreadable

logger = logging.getLogger(__name__)

_LOGGED_REJECTIONS = 20  # the first rejected documents are logged with their file and reason
# Each unit is packed alone (its tail padded). Measured with bestfit, GPT-2 tokenizer, seq_len 1024 on the shared
# prose corpus: 1.27% padding at 1 MiB units, 0.97% at 2 MiB, 0.77% at 4 MiB, against the build's 0.57% (one
# packer over the corpus); 2 MiB keeps within the 0.5 points while a resume re-tokenizes at most 2 MiB of
# text per lane a rank reads.
DEFAULT_UNIT_BYTES = 2 << 20


@dataclass(frozen=True, kw_only=True)
class RawTextSettings(TextRecipe):
    """What raw-text samples depend on (every field is part of the data's fingerprint): how documents become
    samples (`shardkit.text.recipe.TextRecipe`, the fields `shardkit build` takes too) and how the corpus is cut.

    Attributes:
        unit_bytes: approximate bytes per work unit (the unit of tokenization, packing and resume rework).
        lanes: independent streams the units are dealt into (at most the number of units).
    """

    unit_bytes: int = DEFAULT_UNIT_BYTES
    lanes: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("unit_bytes", "lanes"):
            check_count(name, getattr(self, name))


class RawCorpus:
    """The inputs' work units dealt into lanes, and how documents become tokens (small and picklable).

    Raises:
        FileNotFoundError / ValueError: an input matches nothing, is not a text input, or is a Parquet file
            without the text column.
    """

    def __init__(self, inputs: list[str], settings: RawTextSettings, storage_options: dict[str, Any] | None = None):
        self.settings, self.storage_options = settings, storage_options
        self.files: list[InputFile] = expand_inputs(inputs, storage_options)
        # What the listing saw of each file, as plain data: {"name" (relative to its INPUT's root), "size",
        # "change_marker"}; every read checks the file it opens against it (`shardkit.text.inputs.InputChangedError`).
        self.listing: list[dict[str, Any]] = [f.listing() for f in self.files]
        self.tokenizer_info = info = cached_tokenizer(settings.tokenizer).info
        used = with_special_ids(info, eos_id=settings.eos_id, bos_id=settings.bos_id, options=("eos_id", "bos_id"))
        eos, bos, self.pad_id = used.eos_id, used.bos_id, used.pad_id
        self.token_dtype = token_dtype_for_vocab(info.vocab_size)
        self.documents = DocumentSettings(tokenizer=settings.tokenizer, token_dtype=self.token_dtype,
                                          text_field=settings.text_field, eos_id=eos, bos_id=bos,
                                          max_doc_chars=settings.max_doc_chars)
        self.units = list_units(self.files, unit_bytes=settings.unit_bytes, text_field=settings.text_field,
                                storage_options=storage_options)
        sizes = self.units.size
        self.num_lanes = min(settings.lanes, len(sizes))
        self.lanes = lane_units(deal_lanes(sizes, self.num_lanes), self.num_lanes)
        self.identity_parts = corpus_identity_parts(self.files, settings, self.documents, info, units=len(sizes))
        self.fingerprint = _digest(self.identity_parts)
        # What states written before the identity named files by relative name and the tokenizer by content
        # (version 1 states) were bound to: absolute URLs and the tokenizer's spec.
        self.legacy_fingerprint = _digest(
            {"files": [[f.url, f.size] for f in self.files], "settings": asdict(settings), "units": len(sizes),
             "documents": asdict(self.documents)})

    def segments(self, number: int, skip: int = 0) -> Iterator[WorkUnit]:
        """Unit `number`'s segments from segment `skip` on.

        Raises:
            UnreadableInput: the unit's file cannot be read (naming it).
        """
        s, url = self.settings, self.files[int(self.units.source[number])].url
        read = 0
        for segment in read_segments(self.units, self.files, number, skip=skip, unit_bytes=s.unit_bytes,
                                     txt_mode=s.txt_mode, text_field=s.text_field, max_doc_chars=s.max_doc_chars,
                                     storage_options=self.storage_options):
            if segment.file_error:
                # A footer the listing could not read was already broken then; any other failure means the
                # file changed after it was listed.
                broken_when_listed = self.units.footer_errors[int(self.units.source[number])]
                known = broken_when_listed or InputChangedError.__name__ in segment.file_error
                hint = "" if known else " (did it change or vanish since the loader listed its units?)"
                raise UnreadableInput(f"{url}: cannot read it: {segment.file_error}{hint}", segment.file_error,
                                      segment)
            read += 1
            yield segment
        if skip and not read:  # a resume into a segment the file no longer has
            raise UnreadableInput(f"{url}: has no segment {skip} to resume from: it changed since the loader "
                                  "listed it", f"has no segment {skip}: it changed since the loader listed it", None)

    def unit_place(self, number: int) -> str:
        """A unit's file and part, for messages: 'FILE bytes A-B', 'FILE row group G' or the file."""
        return unit_place(self.units, self.files, number, unit_bytes=self.settings.unit_bytes)

    def unit_url(self, number: int) -> str:
        return self.files[int(self.units.source[number])].url

    def record_place(self, segment: WorkUnit, record: int) -> str:
        """Where a rejected record is, as the build's report names it ('line N', 'row N', ...), but 'byte offset
        N' in a byte-range unit (its line number would cost reading the file up to it)."""
        return record_place(segment, record, byte_range=self.units.kinds[segment.source] == RANGE)

    def lane_inputs(self, lane: int) -> list[str]:
        """The files a lane's units come from."""
        return [self.files[s].url for s in sorted(set(self.units.source[self.lanes[lane]].tolist()))]

    def packer(self) -> Packer:
        """A new packer of this corpus's samples (one per segment: its tail padded)."""
        s = self.settings
        return make_packer(s.pack, seq_len=s.seq_len, pad_id=self.pad_id, token_dtype=self.token_dtype,
                           buffer_docs=s.bestfit_buffer, max_open=s.bestfit_open)


class UnreadableInput(OSError):
    """A unit's file cannot be read: why (`reason`) and the failed read (`segment`, whose `rejected` holds an
    incomplete last record), or None."""

    def __init__(self, message: str, reason: str = "", segment: WorkUnit | None = None):
        # Defaults: a DataLoader worker's exception is raised again in the main process from its message alone.
        super().__init__(message)
        self.reason, self.segment = reason or message, segment


class LaneRanDry(ValueError):
    """A lane has no sample past its first `samples`: a whole lane epoch of its units held no accepted document
    (every record rejected, or every unit cut as unreadable). The raw-text loader leaves the lane out of the order
    from there (`sources.raw.dry_lanes`); where it cannot (a mixture's lane, ranks without a process group) this is
    the error."""

    def __init__(self, stream: LaneStream, samples: int):
        corpus, lane = stream.corpus, stream.lane
        cuts = f"; {len(stream.cuts)} unreadable units skipped" if stream.cuts else ""
        lanes, unit_bytes = corpus.num_lanes, corpus.settings.unit_bytes
        self.inputs = ", ".join(corpus.lane_inputs(lane))
        super().__init__(f"lane {lane} of {lanes} holds no accepted document after its first {samples} samples (its "
                         f"inputs: {self.inputs}){cuts}: give fewer lanes "
                         f"({setting('lanes', max(1, lanes // 2))}, now {lanes}: a larger share of the corpus per "
                         f"lane) or larger units ({setting('unit_bytes', 2 * unit_bytes)}, now {unit_bytes}), or "
                         "inputs that hold text")
        self.lane, self.samples = stream.global_lane, samples


class RejectionLog:
    """How many rejected documents one process has logged (the first `_LOGGED_REJECTIONS` are)."""

    def __init__(self) -> None:
        self.logged = 0

    def log(self, url: str, where: Callable[[], str], reason: str) -> None:
        """Log a rejection if it is among the first; `where()` (the record's place) is asked only then: in a
        byte-range unit it scans the unit's payload, which every rejection would otherwise pay."""
        if self.logged < _LOGGED_REJECTIONS:
            self.logged += 1
            logger.warning("%s %s: rejected a document: %s", url, where(), reason)


@dataclass
class LaneCursor:
    """Where a lane stands: samples delivered, its epoch, the unit (position in the epoch's order), the segment
    of that unit, the samples of that segment delivered, and where the next sample begins in the segment: its
    record (line, row or paragraph, numbered from 0 in the segment) and the tokens of its document delivered
    (`sources.raw.segment_samples`; (0, 0): from the segment's start, skipping `within` samples, as bestfit and
    a state saved before these two fields resume)."""

    samples: int = 0
    epoch: int = 0
    unit: int = 0
    segment: int = 0
    within: int = 0
    document: int = 0
    token: int = 0

    def as_tuple(self) -> tuple[int, ...]:
        # not dataclasses.astuple: it deep-copies every field, and the loader asks every lane read at every step
        return (self.samples, self.epoch, self.unit, self.segment, self.within, self.document, self.token)


CURSOR_FIELDS = len(fields(LaneCursor))  # a cursor's entries in a loader state's row, after its lane
OLD_CURSOR_FIELDS = 5  # a state saved before the restart point (document, token) was kept


def cursor_rows(cursors: dict[int, tuple[int, ...]]) -> list[list[int]]:
    """A state's `raw_text.cursors`: [lane, *cursor] per lane, by lane (the inverse of `feed.saved_cursors`)."""
    return [[lane, *cursor] for lane, cursor in sorted(cursors.items())]


class LaneStream:
    """One lane's samples in order, from a cursor on; `take(k)` returns sample k of the lane.

    Units are read as `cuts` say (`sources.raw.unreadable.UnitCuts`); with `skip_unreadable` a unit that cannot be read
    is cut where reading failed (the cut recorded in `unreadable`) and the lane goes on with its next unit. Cuts
    and reports number the units from `unit_offset` and the lane as `global_lane` (default: `lane`): a mixture
    numbers the lanes and units of all its raw streams in one sequence."""

    def __init__(self, corpus: RawCorpus, lane: int, log: RejectionLog, *, seed: int, shuffle: bool,
                 cursor: tuple[int, ...] = (0,) * CURSOR_FIELDS, cuts: UnitCuts | None = None,
                 skip_unreadable: bool = False, global_lane: int | None = None, unit_offset: int = 0):
        self.corpus, self.lane, self.log, self.seed, self.shuffle = corpus, lane, log, seed, shuffle
        self.global_lane, self.unit_offset = lane if global_lane is None else global_lane, unit_offset
        self.cursor = LaneCursor(*cursor)
        self.cuts, self.skip_unreadable = cuts or UnitCuts(), skip_unreadable
        # Where rejected documents are counted and unreadable units reported (the reader points them at its own).
        self.rejected: Counter = Counter()
        self.unreadable: list[Unreadable] = []
        self._units = corpus.lanes[lane]
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, order of the lane's units)
        self._number = -1  # the current unit
        self._end: tuple[int, int] | None = None  # its cut in this lane epoch: (segment, within), or None
        self._segments: Iterator[WorkUnit] | None = None  # the current unit's segments, from the next one on
        self._samples: SegmentSamples | None = None  # the current segment's samples
        self._counting = False  # whether this reader counts the current segment's rejections
        self._current: WorkUnit | None = None  # the current segment
        self._dry_units = 0  # units finished since the last sample delivered
        self._chars = FIRST_CHARS  # text of the next tokenizer call: small first, growing over the lane's segments

    def take(self, k: int) -> tuple[Sample, int]:
        """(sample k of the lane, its lane epoch); samples before k not yet passed are skipped.

        Raises:
            ValueError: k was passed already.
            LaneRanDry: a whole lane epoch holds no accepted document (the lane has no sample k).
        """
        if k < self.cursor.samples:
            raise ValueError(f"lane {self.lane}: sample {k} was passed already (the lane stands at "
                             f"{self.cursor.samples}): a loader state from another run?")
        while True:
            sample, epoch = self._next()
            if self.cursor.samples == k + 1:
                return sample, epoch

    def _next(self) -> tuple[Sample, int]:
        cursor = self.cursor
        while True:
            if self._samples is None:
                self._load()
            cut = self._end is not None and (cursor.segment, cursor.within) >= self._end
            sample = None if cut else self._samples.take()
            self._count_found()
            if sample is not None:
                break
            # the segment is done (or cut): the next one, or the unit's end where it is cut
            cursor.segment, cursor.within, cursor.document, cursor.token = cursor.segment + 1, 0, 0, 0
            self._chars, self._samples = self._samples.batch_chars, None
            if cut:
                self._segments = iter(())
        cursor.within += 1
        cursor.samples += 1
        cursor.document, cursor.token = self._samples.restart()
        self._dry_units = 0
        return sample, cursor.epoch

    def _load(self) -> None:
        """The next segment's samples, moving on to the next unit (and lane epoch) where a unit ends or is cut."""
        cursor = self.cursor
        while True:
            if self._segments is None:
                self._open()
            segment = self._read() if self._end is None or (cursor.segment, cursor.within) < self._end else None
            if segment is not None:
                break
            self._segments = None
            cursor.unit, cursor.segment, cursor.within, cursor.document, cursor.token = cursor.unit + 1, 0, 0, 0, 0
            if cursor.unit == len(self._units):
                cursor.epoch, cursor.unit = cursor.epoch + 1, 0
            self._dry_units += 1
            if self._dry_units > len(self._units):
                raise LaneRanDry(self, self.cursor.samples)
        # Counted as the build counts them (once per corpus: in lane epoch 0) by the reader that starts the
        # segment (a segment resumed into was counted before).
        self._counting = cursor.epoch == 0 and cursor.within == 0
        self._samples = SegmentSamples(segment, self.corpus, within=cursor.within, document=cursor.document,
                                       token=cursor.token, first_chars=self._chars)
        self._current = segment

    def _open(self) -> None:
        """Open the unit the cursor stands at (from its segment on), with its cut in this lane epoch."""
        cursor = self.cursor
        if self._order is None or self._order[0] != cursor.epoch:
            self._order = (cursor.epoch, lane_epoch_order(len(self._units), seed=self.seed, epoch=cursor.epoch,
                                                          lane=self.lane, shuffle=self.shuffle))
        self._number = int(self._units[self._order[1][cursor.unit]])
        self._end = self.cuts.end(self.unit_offset + self._number, cursor.epoch)
        self._segments = self.corpus.segments(self._number, skip=cursor.segment)

    def _read(self) -> WorkUnit | None:
        """The unit's next segment, None at its end; with `skip_unreadable` also where it cannot be read (the
        unit is cut there)."""
        try:
            return next(self._segments, None)
        except UnreadableInput as err:
            if not self.skip_unreadable:
                raise
            cursor = self.cursor
            cut = UnitCut(self.unit_offset + self._number, cursor.epoch, cursor.segment, cursor.within)
            self.cuts = self.cuts.adding([cut])
            self.unreadable.append(Unreadable(cut, self.global_lane, cursor.samples,
                                              self.corpus.unit_place(self._number), err.reason))
            if err.segment is not None and cursor.epoch == 0 and cursor.within == 0:
                self._count(err.segment, err.segment.rejected)  # the build counts a truncated file's last record
            return None

    def _count_found(self) -> None:
        """Count the rejections the current segment found since the last call (its parse's when it opened, the
        tokenizer's as its documents are tokenized), where this reader counts them."""
        if not self._samples.found:  # the common case, at every sample: nothing new
            return
        found, self._samples.found = self._samples.found, []
        if self._counting:
            self._count(self._current, found)

    def _count(self, segment: WorkUnit, rejected: Any) -> None:
        url = self.corpus.files[segment.source].url
        for record, reason in rejected:
            self.rejected[reason_category(reason)] += 1
            self.log.log(url, functools.partial(self.corpus.record_place, segment, record), reason)


def corpus_identity_parts(files: list[InputFile], settings: RawTextSettings, documents: DocumentSettings,
                          tokenizer: Any, *, units: int) -> dict[str, Any]:
    """What raw-text samples depend on, part by part, so that a refused resume names the part that differs: the
    files as the listing saw them (name relative to their input's root and size: a corpus moved, copied or
    mounted elsewhere keeps its identity, a file of another size does not), the tokenizer by the content of its
    vocabulary (a tokenizer retrained in place does not), and every setting of the recipe.

    Not the store's change marker: copies of the same bytes on different nodes differ in it (mtime), and every rank
    must resume the same state (the ranks' agreement, `agreement.py`, leaves it out for the same reason). A file
    rewritten in place with the same size between save and resume is therefore not noticed here; within a run,
    every read checks the marker (`shardkit.text.inputs.InputChangedError`)."""
    recipe = {k: v for k, v in asdict(settings).items() if k != "tokenizer"}
    document_fields = {k: v for k, v in asdict(documents).items() if k not in ("tokenizer", "text_field",
                                                                                "max_doc_chars")}
    listing = [[f.name, f.size] for f in files]
    return {"files": _digest(listing), "file_count": len(files), "units": units,
            "tokenizer": tokenizer.vocab_sha256 or str(settings.tokenizer), **recipe, **document_fields}


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
