"""One segment's samples, made as its documents are tokenized: a lane hands out its first sample once the first
few documents are tokenized, not the whole unit.

A segment (a unit, or a piece of a streamed file) is split into its records at once (cheap: nothing parsed), and
its records are parsed, checked and tokenized a few at a time (`shardkit.text.documents.check_records` and
`tokenize_texts`: a document's tokens never depend on the others in the call) into the segment's packer, which
gives the same samples however its documents are fed (`shardkit.text.packing`). So the samples are exactly those
of tokenizing the whole segment at once.

Where the next sample begins (`restart()`), so that a resume re-reads from there rather than from the segment's
start: with `concat` and `none` the samples follow the token stream, so the next one begins at token `token` of
record `document` of the segment (its records numbered from 0: line, row or paragraph; `token` may be that
document's length: the next one then). Resuming there parses and tokenizes from that record on with a fresh packer,
which gives the same next samples: a concat window or a `none` piece never depends on the tokens before its first.
(0, 0) is the segment's start. `bestfit` windows hold pieces of documents from anywhere before them (up to
`bestfit_open` windows), so its restart point is always (0, 0): a resume re-tokenizes the segment up to the saved
sample, as before.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from shardkit.formats import Sample
from shardkit.text.documents import check_records, tokenize_texts, unit_records
from shardkit.text.inputs import WorkUnit

# Text characters tokenized per call: small at first (the first sample needs a few documents), doubling to a
# size where the per-call cost is negligible against the encoding. A lane carries its size from one segment to the
# next (`first_chars`): an HF tokenizer costs ~25% more per token in 8 KiB calls than in 64 KiB ones (measured on
# the shared mix corpus, GPT-2), so only a lane's first calls are small, not every segment's.
FIRST_CHARS, _MOST_CHARS = 1 << 13, 1 << 18
STREAM_ORDER_PACKINGS = ("concat", "none")  # packings whose samples follow the token stream (a restart point)


class SegmentSamples:
    """The samples of one segment, in order, from sample `within` on.

    Args:
        segment: the segment read (`sources.raw.units.read_segments`).
        corpus: the `RawCorpus` (its document settings and packer).
        within: the number of the first sample to hand out.
        document, token: where sample `within` begins (`restart()` of the sample before it); (0, 0): at the
            segment's start, so samples before `within` are made again and skipped.
        first_chars: text characters of the first tokenizer call (doubling, call after call, up to 256 KiB;
            `batch_chars` holds the next call's, which the lane hands to its next segment).
    """

    def __init__(self, segment: WorkUnit, corpus: Any, *, within: int = 0, document: int = 0, token: int = 0,
                 first_chars: int = FIRST_CHARS):
        s = corpus.settings
        self.records = unit_records(segment, s.text_field)
        self.kind, self.first_record = segment.kind, segment.first_record
        self.found: list[tuple[int, str]] = list(segment.rejected)  # rejections not yet counted by the lane
        self.corpus, self.source = corpus, segment.source
        self.packer = corpus.packer()
        self.follows_stream = s.pack in STREAM_ORDER_PACKINGS
        if (document, token) != (0, 0) and not self.follows_stream:
            raise ValueError(f"a restart point ({document}, {token}) for pack={s.pack!r}, which has none")
        if document > len(self.records):
            raise ValueError(f"a restart point at record {document} of a segment of {len(self.records)}: the input "
                             "changed since the state was saved")
        self.ready: deque[tuple[Sample, tuple[int, int]]] = deque()
        self.skip = within if (document, token) == (0, 0) else 0
        self.next_document, self.trim = document, token
        self.chars = np.cumsum([0, *(len(raw) for _, raw in self.records)])
        self.batch_chars = min(first_chars, _MOST_CHARS)
        self.finished = False
        # the record of the last token handed to samples and how many of its tokens they hold
        self.last_doc, self.last_count = (self.first_record + document, token) if token else (-1, 0)
        self._restart = (document, token)

    def take(self) -> Sample | None:
        """The next sample, or None at the segment's end."""
        while not self.ready and not self.finished:
            self._make()
        if not self.ready:
            return None
        sample, self._restart = self.ready.popleft()
        return sample

    def restart(self) -> tuple[int, int]:
        """(document, token) where the sample after the last one taken begins ((0, 0) for bestfit)."""
        return self._restart if self.follows_stream else (0, 0)

    def _make(self) -> None:
        """Parse and tokenize the next few records into the packer (or finish it) and keep the samples it
        completes."""
        first = self.next_document
        if first >= len(self.records):
            self._keep(self.packer.finish())
            self.finished = True
            return
        last = int(np.searchsorted(self.chars, self.chars[first] + self.batch_chars, side="left"))
        last = min(max(last, first + 1), len(self.records))
        self.batch_chars = min(2 * self.batch_chars, _MOST_CHARS)
        self.next_document = last
        s = self.corpus.settings
        ids, texts, rejected = check_records(self.kind, self.records[first:last], text_field=s.text_field,
                                             max_doc_chars=s.max_doc_chars)
        documents = tokenize_texts(ids, texts, self.corpus.documents)
        self.found.extend(sorted([*rejected, *documents.rejected]))
        tokens, lengths, doc_index = documents.tokens, documents.lengths, documents.doc_index
        if self.trim:  # resumed inside this record's document: its first `trim` tokens went into samples already
            if not len(doc_index) or doc_index[0] != self.first_record + first or lengths[0] < self.trim:
                raise ValueError(f"record {first} of the segment no longer holds the document a loader state "
                                 "resumes inside: the input changed since the state was saved")
            tokens, lengths = tokens[self.trim:], lengths.copy()
            lengths[0] -= self.trim
            if not lengths[0]:
                lengths, doc_index = lengths[1:], doc_index[1:]
            self.trim = 0
        self._keep(self.packer.feed(tokens, lengths, self.source, doc_index))

    def _keep(self, arrays: Any) -> None:
        for sample in arrays:
            restart = self._follow(sample) if self.follows_stream else (0, 0)
            if self.skip:
                self.skip -= 1
            else:
                self.ready.append((sample, restart))

    def _follow(self, sample: Sample) -> tuple[int, int]:
        """Where the sample after `sample` begins, following the token stream."""
        if int(sample.doc_source[-1]) < 0:  # padded: the segment's last sample
            return len(self.records), 0
        doc = int(sample.doc_index[-1])
        held = len(sample.tokens) - int(sample.doc_starts[-1])
        self.last_count = self.last_count + held if len(sample.doc_index) == 1 and doc == self.last_doc else held
        self.last_doc = doc
        return doc - self.first_record, self.last_count
