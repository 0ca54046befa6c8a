"""One segment's samples, made as its documents are tokenized: a lane hands out its first sample once the first
few documents are tokenized, not the whole unit.

A segment (a unit, or a piece of a streamed file) is parsed at once (cheap: no tokenizer) and its documents are
tokenized a few at a time (`shardkit.text.documents.tokenize_texts`: a document's tokens never depend on the
others in the call) into the segment's packer, which gives the same samples however its documents are fed
(`shardkit.text.packing`). So the samples are exactly those of tokenizing the whole segment at once.

Where the next sample begins (`restart()`), so that a resume re-reads from there rather than from the segment's
start: with `concat` and `none` the samples follow the token stream, so the next one begins at token `token` of
document `document` (the segment's parsed documents numbered from 0; `token` may be that document's length: the
next one then). Resuming there tokenizes from that document on with a fresh packer, which gives the same next
samples: a concat window or a `none` piece never depends on the tokens before its first. (0, 0) is the segment's
start. `bestfit` windows hold pieces of documents from anywhere before them (up to `bestfit_open` windows), so
its restart point is always (0, 0): a resume re-tokenizes the segment up to the saved sample, as before.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from shardkit.formats import Sample
from shardkit.text.documents import parse_unit, tokenize_texts
from shardkit.text.inputs import WorkUnit

# Text characters tokenized per call: small at first (the first sample needs a few documents), doubling to a
# size where the per-call cost is negligible against the encoding.
_FIRST_CHARS, _MOST_CHARS = 1 << 13, 1 << 18
STREAM_ORDER_PACKINGS = ("concat", "none")  # packings whose samples follow the token stream (a restart point)


class SegmentSamples:
    """The samples of one segment, in order, from sample `within` on.

    Args:
        segment: the segment read (`sources.raw.units.read_segments`).
        corpus: the `RawCorpus` (its document settings and packer).
        within: the number of the first sample to hand out.
        document, token: where sample `within` begins (`restart()` of the sample before it); (0, 0): at the
            segment's start, so samples before `within` are made again and skipped.
    """

    def __init__(self, segment: WorkUnit, corpus: Any, *, within: int = 0, document: int = 0, token: int = 0):
        s = corpus.settings
        ids, self.texts, rejected, _ = parse_unit(segment, text_field=s.text_field, max_doc_chars=s.max_doc_chars)
        self.ids = np.asarray(ids, dtype=np.int64)
        self.found: list[tuple[int, str]] = list(rejected)  # rejections not yet counted by the lane
        self.corpus, self.source = corpus, segment.source
        self.packer = corpus.packer()
        self.follows_stream = s.pack in STREAM_ORDER_PACKINGS
        if (document, token) != (0, 0) and not self.follows_stream:
            raise ValueError(f"a restart point ({document}, {token}) for pack={s.pack!r}, which has none")
        if document > len(self.texts):
            raise ValueError(f"a restart point at document {document} of a segment of {len(self.texts)}: the input "
                             "changed since the state was saved")
        self.ready: deque[tuple[Sample, tuple[int, int]]] = deque()
        self.skip = within if (document, token) == (0, 0) else 0
        self.next_document, self.trim = document, token
        self.chars = np.cumsum([0, *map(len, self.texts)])
        self.batch_chars = _FIRST_CHARS
        self.finished = False
        # the document of the last token handed to samples and how many of its tokens they hold
        self.last_doc, self.last_count = (int(self.ids[document]), token) if token else (-1, 0)
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
        """Tokenize the next few documents into the packer (or finish it) and keep the samples it completes."""
        first = self.next_document
        if first >= len(self.texts):
            self._keep(self.packer.finish())
            self.finished = True
            return
        last = int(np.searchsorted(self.chars, self.chars[first] + self.batch_chars, side="left"))
        last = min(max(last, first + 1), len(self.texts))
        self.batch_chars = min(2 * self.batch_chars, _MOST_CHARS)
        self.next_document = last
        documents = tokenize_texts(self.ids[first:last].tolist(), self.texts[first:last], self.corpus.documents)
        self.found.extend(documents.rejected)
        tokens, lengths, doc_index = documents.tokens, documents.lengths, documents.doc_index
        if self.trim:  # resumed inside this document: its first `trim` tokens went into samples already
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
            return len(self.texts), 0
        doc = int(sample.doc_index[-1])
        held = len(sample.tokens) - int(sample.doc_starts[-1])
        self.last_count = self.last_count + held if len(sample.doc_index) == 1 and doc == self.last_doc else held
        self.last_doc = doc
        return int(np.searchsorted(self.ids, doc)), self.last_count
