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
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardkit.formats import Sample, ShardArrays
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
        self.ready: deque[_Run] = deque()
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
        run = self.ready[0]
        row = run.next
        run.next += 1
        if run.next == run.stop:
            self.ready.popleft()
        self._restart = (run.documents[row], run.tokens[row])
        return run.sample(row)

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

    def _keep(self, arrays: ShardArrays) -> None:
        """Keep the samples a packer call completed, past the `skip` ones, with the restart point after each:
        one run of samples, its restart points computed for the whole run at once."""
        count = arrays.num_samples
        if not count:
            return
        if count == 1 and arrays.doc_source[-1] < 0:  # a finished packer's padded sample: the segment's end
            documents, tokens = [len(self.records) if self.follows_stream else 0], [0]
        elif self.follows_stream:
            documents, tokens = self._follow(arrays)
        else:
            documents = tokens = [0] * count
        first = min(self.skip, count)
        self.skip -= first
        if first < count:
            self.ready.append(_Run(arrays, documents, tokens, first))

    def _follow(self, arrays: ShardArrays) -> tuple[list[int], list[int]]:
        """Where the sample after each of `arrays`' samples begins, following the token stream: (record of the
        segment, tokens of its document in samples so far) lists, one entry per sample.

        A sample's next one begins in the document of its last segment, after the tokens of that document held
        by this sample and, where this sample holds nothing else, by the samples before it that held only that
        document too (a document spanning several windows): a sum restarted wherever that chain breaks."""
        last = arrays.doc_offsets[1:] - 1  # each sample's last segment
        docs = arrays.doc_index[last]
        held = np.diff(arrays.sample_offsets) - arrays.doc_starts[last]
        previous = np.concatenate([[self.last_doc], docs[:-1]])
        goes_on = (np.diff(arrays.doc_offsets) == 1) & (docs == previous)
        totals = np.cumsum(held)
        # counts[i] = totals[i] - totals before the sample where the chain through i began (the carry before the
        # first sample, where the chain began before this run)
        began = np.maximum.accumulate(np.where(goes_on, -1, np.arange(len(docs))))
        before = np.where(began >= 0, totals[np.maximum(began, 0)] - held[np.maximum(began, 0)], -self.last_count)
        counts = totals - before
        padded = arrays.doc_source[last] < 0  # only the segment's last sample: nothing after it
        documents = np.where(padded, len(self.records), docs - self.first_record)
        counts = np.where(padded, 0, counts)
        if not padded[-1]:
            self.last_doc, self.last_count = int(docs[-1]), int(counts[-1])
        return documents.tolist(), counts.tolist()


@dataclass(frozen=True)
class LaneSample(Sample):
    """A raw-text lane's sample: a `Sample` with the lengths of its document segments (None where it holds a
    padding segment), so that a batch of such rows gets its `cu_seqlens` by one running sum
    (`sources.raw.batches.raw_batch`)."""

    segment_lengths: np.ndarray | None = None


class _Run:
    """Samples a packer call completed (`arrays`), rows `next` to the last not yet taken, the restart point after
    each (`documents`, `tokens`: `SegmentSamples.restart`), and their segments' lengths, worked out for the
    whole run at once."""

    def __init__(self, arrays: ShardArrays, documents: list[int], tokens: list[int], first: int):
        self.arrays, self.documents, self.tokens, self.next = arrays, documents, tokens, first
        self.stop = arrays.num_samples
        # Python ints: a sample's slices then cost no array indexing
        self.offsets, self.doc_offsets = arrays.sample_offsets.tolist(), arrays.doc_offsets.tolist()
        # a finished packer's one padded sample is never regular: spare it the arrays' work
        self.lengths, self.regular = _segment_lengths(arrays) if self.stop > 1 or arrays.doc_source[-1] >= 0 \
            else (arrays.doc_starts, [False])

    def sample(self, row: int) -> LaneSample:
        a = self.arrays
        t0, t1, d0, d1 = self.offsets[row], self.offsets[row + 1], self.doc_offsets[row], self.doc_offsets[row + 1]
        return LaneSample(a.tokens[t0:t1], a.doc_starts[d0:d1], a.doc_source[d0:d1], a.doc_index[d0:d1],
                          self.lengths[d0:d1] if self.regular[row] else None)


def _segment_lengths(arrays: ShardArrays) -> tuple[np.ndarray, list[bool]]:
    """The length of every document segment of `arrays`, and for each sample whether its segments are regular:
    the first at 0, none empty, none padding (a batch of regular rows needs no sort for its `cu_seqlens`)."""
    count = arrays.num_samples
    pieces = np.diff(arrays.doc_offsets)
    owner = np.repeat(np.arange(count, dtype=np.int64), pieces)
    starts = arrays.sample_offsets[owner] + arrays.doc_starts
    ends = np.empty_like(starts)
    ends[:-1] = starts[1:]
    held = pieces > 0
    ends[arrays.doc_offsets[1:][held] - 1] = arrays.sample_offsets[1:][held]  # a sample's last segment: its end
    lengths = ends - starts
    odd = np.bincount(owner[(lengths <= 0) | (arrays.doc_source < 0)], minlength=count) > 0
    odd[held] |= arrays.doc_starts[arrays.doc_offsets[:-1][held]] != 0
    return lengths.astype(np.int32), (held & ~odd).tolist()
