"""Reading raw text lane by lane: the corpus's units, a unit reader, and one lane's stream of packed samples.

`RawCorpus` lists the inputs' work units once (`shardkit.text.inputs.iter_units`, the build's reader) and deals
them into lanes (`raw_lanes.deal_lanes`). A `LaneStream` turns one lane into samples: its units in the lane
epoch's order, each tokenized (`shardkit.text.documents.tokenize_unit`) and packed on its own by the build's
packer (`shardkit.text.packing.make_packer`, finished at the unit's end), so a lane's position is a small
cursor: (samples delivered, lane epoch, unit in the epoch's order, samples of that unit delivered). Resuming
from a cursor re-tokenizes one unit and skips into it; no packer buffer is ever saved.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from shardkit.formats import Sample
from shardkit.manifest import token_dtype_for_vocab
from shardkit.text.documents import DocumentSettings, cached_tokenizer, reason_category, tokenize_unit
from shardkit.text.inputs import InputFile, WorkUnit, expand_inputs, iter_units
from shardkit.text.packing import PACKING_MODES, make_packer
from shardkit.text.tokenizers import special_id

from .raw_lanes import deal_lanes, lane_epoch_order, lane_units

logger = logging.getLogger(__name__)

_LOGGED_REJECTIONS = 20  # the first rejected documents are logged with their file and reason
_LIVE_FILES = 4  # open unit readers kept per process (sequential units of one file read on without reopening)


@dataclass(frozen=True, kw_only=True)
class RawTextSettings:
    """What raw-text samples depend on (every field is part of the data's fingerprint).

    Attributes:
        tokenizer: tokenizer spec (`shardkit.text.tokenizers.load_tokenizer`), as `shardkit build --tokenizer`.
        seq_len: tokens a model reads per sample (packed windows hold seq_len + 1).
        pack: "concat", "bestfit" or "none" (`shardkit.text.packing`).
        text_field: JSON key / Parquet column of the text.
        txt_mode: "file" or "paragraph" (what one document of a .txt file is).
        unit_bytes: approximate bytes per work unit (the unit of tokenization, packing and resume rework).
        lanes: independent streams the units are dealt into (at most the number of units).
        eos_id, bos_id: "auto" (the tokenizer's), an integer, or None.
        max_doc_chars: longer documents are rejected.
        bestfit_buffer, bestfit_open: bestfit's buffer and open windows (per unit).
    """

    tokenizer: str
    seq_len: int
    pack: str = "concat"
    text_field: str = "text"
    txt_mode: str = "file"
    unit_bytes: int = 1 << 20
    lanes: int = 64
    eos_id: int | str | None = "auto"
    bos_id: int | str | None = None
    max_doc_chars: int = 10_000_000
    bestfit_buffer: int = 2048
    bestfit_open: int = 512

    def __post_init__(self) -> None:
        if self.pack not in PACKING_MODES:
            raise ValueError(f"pack must be one of {PACKING_MODES}, got {self.pack!r}")
        for name in ("seq_len", "unit_bytes", "lanes", "max_doc_chars", "bestfit_buffer"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _unit_size(unit: WorkUnit) -> int:
    payload = unit.payload
    return int(getattr(payload, "nbytes", None) or len(payload) or 1)


class RawCorpus:
    """The inputs' work units dealt into lanes, and how documents become tokens (small and picklable).

    Raises:
        FileNotFoundError / ValueError: an input matches nothing or is not a text input.
        OSError: an input cannot be read (naming it).
    """

    def __init__(self, inputs: list[str], settings: RawTextSettings, storage_options: dict[str, Any] | None = None):
        self.settings, self.storage_options = settings, storage_options
        self.files: list[InputFile] = expand_inputs(inputs, storage_options)
        self.tokenizer_info = info = cached_tokenizer(settings.tokenizer).info
        eos = special_id(settings.eos_id, info.eos_id, "eos_id", info.vocab_size)
        bos = special_id(settings.bos_id, info.bos_id, "bos_id", info.vocab_size)
        self.pad_id = info.pad_id if info.pad_id is not None else (eos if eos is not None else 0)
        self.token_dtype = token_dtype_for_vocab(info.vocab_size)
        self.documents = DocumentSettings(tokenizer=settings.tokenizer, token_dtype=self.token_dtype,
                                          text_field=settings.text_field, eos_id=eos, bos_id=bos,
                                          max_doc_chars=settings.max_doc_chars)
        sources, file_units, sizes = [], [], []
        for unit in self.units_from(0, 0, 0):
            if unit.file_error:
                raise OSError(f"{self.files[unit.source].url}: cannot read it: {unit.file_error}")
            sources.append(unit.source)
            file_units.append(unit.file_unit)
            sizes.append(_unit_size(unit))
        self.unit_source, self.unit_file_unit = np.array(sources, dtype=np.int64), np.array(file_units, dtype=np.int64)
        self.num_lanes = min(settings.lanes, len(sizes))
        if not sizes:
            raise ValueError(f"the inputs {inputs} hold no text")
        self.lanes = lane_units(deal_lanes(np.array(sizes), self.num_lanes), self.num_lanes)
        self.fingerprint = hashlib.sha256(json.dumps(
            {"files": [[f.url, f.size] for f in self.files], "settings": asdict(settings), "units": len(sizes),
             "documents": asdict(self.documents)}, sort_keys=True, default=str).encode()).hexdigest()

    def units_from(self, index: int, source: int, file_unit: int) -> Iterator[WorkUnit]:
        s = self.settings
        return iter_units(self.files, text_field=s.text_field, txt_mode=s.txt_mode, unit_bytes=s.unit_bytes,
                          max_doc_chars=s.max_doc_chars, storage_options=self.storage_options,
                          start=(index, source, file_unit))

    def pack_unit(self, unit: WorkUnit) -> tuple[list[Sample], tuple[tuple[int, str], ...]]:
        """The unit's samples (tokenized and packed on its own, the tail kept) and its rejected records."""
        s = self.settings
        result = tokenize_unit(unit, self.documents)
        packer = make_packer(s.pack, seq_len=s.seq_len, pad_id=self.pad_id, token_dtype=self.token_dtype,
                             buffer_docs=s.bestfit_buffer, max_open=s.bestfit_open)
        fed = packer.feed(result.tokens, result.doc_lengths, result.source, result.doc_index)
        return [*fed, *packer.finish()], result.rejected


class UnitReader:
    """Reads units by number; the next unit of a file is read on from where the last one ended."""

    def __init__(self, corpus: RawCorpus):
        self.corpus = corpus
        self._live: dict[int, tuple[Iterator[WorkUnit], int]] = {}  # source -> (units, next file unit)
        self.logged = 0  # rejected documents logged by this reader's streams

    def read(self, number: int) -> WorkUnit:
        corpus = self.corpus
        source, file_unit = int(corpus.unit_source[number]), int(corpus.unit_file_unit[number])
        units, next_unit = self._live.pop(source, (None, -1))
        if units is None or next_unit > file_unit:
            units, next_unit = corpus.units_from(number, source, file_unit), file_unit
        unit = None
        while next_unit <= file_unit:
            unit = next(units, None)
            next_unit += 1
            if unit is None or unit.source != source:
                break
        if unit is None or unit.source != source or unit.file_unit != file_unit or unit.file_error:
            url = corpus.files[source].url
            why = (unit.file_error if unit is not None and unit.source == source and unit.file_error
                   else "it changed or vanished since the loader listed its units")
            raise OSError(f"{url}: cannot read its work unit {file_unit}: {why}")
        self._live[source] = (units, next_unit)
        while len(self._live) > _LIVE_FILES:
            self._live.pop(next(iter(self._live)))
        return unit


@dataclass
class LaneCursor:
    """Where a lane stands: samples delivered, its epoch, the unit (position in the epoch's order) and the
    samples of that unit delivered."""

    samples: int = 0
    epoch: int = 0
    unit: int = 0
    within: int = 0

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.samples, self.epoch, self.unit, self.within)


class LaneStream:
    """One lane's samples in order, from a cursor on; `take(k)` returns sample k of the lane."""

    def __init__(self, corpus: RawCorpus, lane: int, reader: UnitReader, *, seed: int, shuffle: bool,
                 cursor: tuple[int, ...] = (0, 0, 0, 0), rejected: Counter | None = None):
        self.corpus, self.lane, self.reader, self.seed, self.shuffle = corpus, lane, reader, seed, shuffle
        self.cursor = LaneCursor(*cursor)
        self.rejected = rejected if rejected is not None else Counter()
        self._units = corpus.lanes[lane]
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, order of the lane's units)
        self._samples: list[Sample] | None = None  # the current unit's samples

    def take(self, k: int) -> tuple[Sample, int]:
        """(sample k of the lane, its lane epoch); samples before k not yet passed are skipped.

        Raises:
            ValueError: k was passed already, or a whole lane epoch holds no accepted document.
        """
        if k < self.cursor.samples:
            raise ValueError(f"lane {self.lane}: sample {k} was passed already (the lane stands at "
                             f"{self.cursor.samples}): a loader state from another run?")
        while True:
            sample, epoch = self._next()
            if self.cursor.samples == k + 1:
                return sample, epoch

    def _next(self) -> tuple[Sample, int]:
        cursor, empty_units = self.cursor, 0
        while self._samples is None or cursor.within >= len(self._samples):
            if self._samples is not None:  # the unit is done: the next one, or the next lane epoch
                self._advance()
                empty_units += 1
                if empty_units > len(self._units):
                    raise ValueError(f"lane {self.lane} of {self.corpus.num_lanes} holds no accepted document: "
                                     "give fewer lanes (a larger share of the corpus per lane)")
            self._load()
        sample, epoch = self._samples[cursor.within], cursor.epoch
        cursor.within += 1
        cursor.samples += 1
        if cursor.within == len(self._samples):  # a cursor never points at a finished unit
            self._advance()
        return sample, epoch

    def _advance(self) -> None:
        cursor = self.cursor
        cursor.unit, cursor.within = cursor.unit + 1, 0
        if cursor.unit == len(self._units):
            cursor.epoch, cursor.unit = cursor.epoch + 1, 0
        self._samples = None

    def _load(self) -> None:
        cursor = self.cursor
        if self._order is None or self._order[0] != cursor.epoch:
            self._order = (cursor.epoch, lane_epoch_order(len(self._units), seed=self.seed, epoch=cursor.epoch,
                                                          lane=self.lane, shuffle=self.shuffle))
        number = int(self._units[self._order[1][cursor.unit]])
        unit = self.reader.read(number)
        self._samples, rejected = self.corpus.pack_unit(unit)
        # Counted as the build counts them (once per corpus: in lane epoch 0), when the unit starts (a unit
        # resumed into was counted before).
        if cursor.epoch == 0 and cursor.within == 0:
            for _, reason in rejected:
                self.rejected[reason_category(reason)] += 1
                if self.reader.logged < _LOGGED_REJECTIONS:
                    self.reader.logged += 1
                    logger.warning("%s: rejected a document: %s", self.corpus.files[unit.source].url, reason)
