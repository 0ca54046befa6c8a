"""Packers: turn a stream of tokenized documents into samples, deterministically.

Documents arrive in build order as (tokens, lengths, source, doc_index) batches; each document's
tokens already hold its BOS/EOS. Every packer is a deterministic function of that stream: the same
documents always give the same samples, however they were batched. Each sample keeps its document
segments (`doc_starts`, `doc_source`, `doc_index`; source -1 marks padding). The samples a batch
completes come out as one `ShardArrays` (flat arrays, what `ShardWriter.write_arrays` takes): `concat`
and `none` cut them with array operations over the whole batch, so their cost does not grow with the
number of documents or windows in Python.

- ``concat``: documents are joined and cut into windows of ``seq_len + 1`` tokens. Windows do not
  overlap: the model reads ``window[:-1]`` as input and ``window[1:]`` as targets, so each token is a
  target exactly once (a document continuing into the next window keeps its doc_index there, and
  counts once as a split document). The
  final partial window is padded to full length with the pad id (a padding segment, source -1) and
  reported; no token is dropped.
- ``bestfit``: best-fit-decreasing bin packing of whole documents into ``seq_len + 1`` windows. A
  buffer of up to ``buffer_docs`` documents is sorted longest first and each document is placed in
  the open window with the least room that still fits it; at most ``max_open`` partly filled
  windows stay open between buffers (the fullest are closed, padded, when there are more). A
  document longer than a window is split: its leading full windows are emitted as they are and its
  tail is packed like a document; splits are counted.
- ``none``: one document per sample, variable length; documents longer than ``seq_len + 1`` are
  split into consecutive samples of at most that length.

Packers expose `snapshot()` / `restore()` (a small dict of scalars and arrays) so that a build can
resume exactly where a checkpoint left off.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from shardkit.formats import Sample, ShardArrays, arrays_from_samples
from shardkit.formats.sample import OFFSETS_DTYPE
from shardkit.wording import option

PACKING_MODES = ("concat", "bestfit", "none")
_I32 = np.int32
_I64 = np.int64


@dataclass
class PackStats:
    """Counters a packer keeps (restored with its state)."""

    samples: int = 0
    documents: int = 0
    document_tokens: int = 0
    padding_tokens: int = 0
    split_documents: int = 0
    final_partial_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def _sample(tokens: np.ndarray, starts, sources, indices) -> Sample:
    return Sample(tokens, np.asarray(starts, dtype=_I32), np.asarray(sources, dtype=_I32),
                  np.asarray(indices, dtype=_I64))


@dataclass
class Packer:
    """Base class: `sample_length` tokens per window, `pad_id` for padding, ids as `token_dtype`."""

    sample_length: int
    pad_id: int
    token_dtype: str
    stats: PackStats = field(default_factory=PackStats)

    def __post_init__(self) -> None:
        if self.sample_length < 2:
            raise ValueError(f"{option('seq_len')} must be >= 1 (a window holds seq_len + 1 tokens), got "
                             f"{self.sample_length - 1}")
        self.dtype = np.dtype(self.token_dtype)

    def feed(self, tokens: np.ndarray, lengths: np.ndarray, source: int, doc_index: np.ndarray) -> ShardArrays:
        """Add a batch of documents from one source; return the samples completed by it."""
        raise NotImplementedError

    def finish(self) -> ShardArrays:
        """Flush what is left (padded where the packing is fixed-length)."""
        return self._arrays([])

    def _arrays(self, samples: list[Sample]) -> ShardArrays:
        return arrays_from_samples(samples, self.token_dtype)

    def snapshot(self) -> dict:
        return {"stats": self.stats.as_dict()}

    def restore(self, state: dict) -> None:
        self.stats = PackStats(**state["stats"])

    def _count(self, samples: ShardArrays, lengths: np.ndarray) -> ShardArrays:
        self.stats.samples += samples.num_samples
        self.stats.documents += len(lengths)
        self.stats.document_tokens += int(lengths.sum())
        return samples


class ConcatPacker(Packer):
    """Join documents and cut fixed windows (see the module docstring)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._reset()

    def _reset(self) -> None:
        self._last_split: tuple[int, int] = (-1, -1)  # last document counted as split (it may span many windows)
        self._carry = np.zeros(0, dtype=self.dtype)
        self._starts = np.zeros(0, dtype=_I64)
        self._sources = np.zeros(0, dtype=_I64)
        self._indices = np.zeros(0, dtype=_I64)

    def feed(self, tokens, lengths, source, doc_index):
        lengths = np.asarray(lengths, dtype=_I64)
        if not len(lengths):
            return self._arrays([])
        buffer = np.concatenate([self._carry, np.asarray(tokens, dtype=self.dtype)])
        offsets = np.zeros(len(lengths), dtype=_I64)
        np.cumsum(lengths[:-1], out=offsets[1:])
        starts = np.concatenate([self._starts, offsets + len(self._carry)])
        sources = np.concatenate([self._sources, np.full(len(lengths), source, dtype=_I64)])
        indices = np.concatenate([self._indices, np.asarray(doc_index, dtype=_I64)])
        length = self.sample_length
        windows = len(buffer) // length
        window_starts = np.arange(windows, dtype=_I64) * length
        # Window w holds the segments of documents first[w] .. last[w] - 1.
        first = np.searchsorted(starts, window_starts, side="right") - 1
        last = np.searchsorted(starts, window_starts + length, side="left")
        self._count_splits(window_starts + length, last, starts, sources, indices, len(buffer))
        counts = last - first
        doc_offsets = np.zeros(windows + 1, dtype=OFFSETS_DTYPE)
        np.cumsum(counts, out=doc_offsets[1:])
        owner = np.repeat(np.arange(windows, dtype=_I64), counts)
        segment = np.arange(int(doc_offsets[-1]), dtype=_I64) - doc_offsets[owner] + first[owner]
        cut = windows * length
        samples = ShardArrays(buffer[:cut], np.arange(windows + 1, dtype=OFFSETS_DTYPE) * length, doc_offsets,
                              np.maximum(starts[segment] - window_starts[owner], 0).astype(_I32),
                              sources[segment].astype(_I32), indices[segment])
        first = int(np.searchsorted(starts, cut, side="right")) - 1 if cut < len(buffer) else len(starts)
        self._carry = buffer[cut:].copy()
        self._starts = np.maximum(starts[first:] - cut, 0)
        self._sources = sources[first:]
        self._indices = indices[first:]
        return self._count(samples, lengths)

    def _count_splits(self, window_ends, last, starts, sources, indices, buffered: int) -> None:
        """Count the documents that windows close inside (buffers hold whole documents), each once even
        when it spans many windows: consecutive windows closing inside the same document count one."""
        inside = (window_ends < buffered) & (np.append(starts, -1)[last] != window_ends)
        split_sources, split_indices = sources[last[inside] - 1], indices[last[inside] - 1]
        if not len(split_sources):
            return
        previous_sources = np.concatenate([[self._last_split[0]], split_sources[:-1]])
        previous_indices = np.concatenate([[self._last_split[1]], split_indices[:-1]])
        self.stats.split_documents += int(np.count_nonzero((split_sources != previous_sources)
                                                           | (split_indices != previous_indices)))
        self._last_split = (int(split_sources[-1]), int(split_indices[-1]))

    def finish(self):
        if not len(self._carry):
            return self._arrays([])
        pad = self.sample_length - len(self._carry)
        tokens = np.concatenate([self._carry, np.full(pad, self.pad_id, dtype=self.dtype)])
        segments = len(self._starts) + 1
        # Made directly rather than through `arrays_from_samples`, whose checks cost more than the packing of a
        # whole 64 KiB unit: the raw-text loader finishes a packer at every segment's end.
        sample = ShardArrays(tokens, np.array([0, len(tokens)], dtype=OFFSETS_DTYPE),
                             np.array([0, segments], dtype=OFFSETS_DTYPE),
                             np.append(self._starts, len(self._carry)).astype(_I32),
                             np.append(self._sources, -1).astype(_I32), np.append(self._indices, -1).astype(_I64))
        self.stats.final_partial_tokens = len(self._carry)
        self.stats.padding_tokens += pad
        self.stats.samples += 1
        self._carry = np.zeros(0, dtype=self.dtype)
        self._starts = self._sources = self._indices = np.zeros(0, dtype=_I64)
        return sample

    def snapshot(self):
        return {**super().snapshot(), "carry": self._carry, "starts": self._starts, "sources": self._sources,
                "indices": self._indices, "last_split": list(self._last_split)}

    def restore(self, state):
        super().restore(state)
        self._carry = np.asarray(state["carry"], dtype=self.dtype)
        self._starts, self._sources, self._indices = (np.asarray(state[k], dtype=_I64)
                                                      for k in ("starts", "sources", "indices"))
        self._last_split = tuple(int(v) for v in state["last_split"])


class NonePacker(Packer):
    """One document per sample, split at `sample_length` tokens."""

    def feed(self, tokens, lengths, source, doc_index):
        lengths = np.asarray(lengths, dtype=_I64)
        tokens = np.asarray(tokens, dtype=self.dtype)
        length = self.sample_length
        self.stats.split_documents += int(np.count_nonzero(lengths > length))
        # Document d becomes ceil(n / length) consecutive samples: the tokens stay in place, only the
        # sample offsets and the one segment per sample are made.
        pieces = -(-lengths // length)
        owner = np.repeat(np.arange(len(lengths), dtype=_I64), pieces)
        piece_starts = np.zeros(len(lengths), dtype=_I64)
        np.cumsum(pieces[:-1], out=piece_starts[1:])
        within = (np.arange(len(owner), dtype=_I64) - piece_starts[owner]) * length
        offsets = np.zeros(len(owner) + 1, dtype=OFFSETS_DTYPE)
        np.cumsum(np.minimum(lengths[owner] - within, length), out=offsets[1:])
        samples = ShardArrays(tokens[:int(offsets[-1])], offsets, np.arange(len(owner) + 1, dtype=OFFSETS_DTYPE),
                              np.zeros(len(owner), dtype=_I32), np.full(len(owner), source, dtype=_I32),
                              np.asarray(doc_index, dtype=_I64)[owner])
        return self._count(samples, lengths)


@dataclass
class _Bin:
    seq: int
    pieces: list = field(default_factory=list)  # (tokens, source, index)
    used: int = 0


class BestFitPacker(Packer):
    """Best-fit-decreasing packing within a bounded buffer (see the module docstring)."""

    def __init__(self, sample_length: int, pad_id: int, token_dtype: str, *, buffer_docs: int = 2048,
                 max_open: int = 512):
        if buffer_docs < 1 or max_open < 0:
            raise ValueError("bestfit buffer_docs must be >= 1 and max_open >= 0")
        super().__init__(sample_length, pad_id, token_dtype)
        self.buffer_docs = buffer_docs
        self.max_open = max_open
        self._pending: list[tuple[np.ndarray, int, int]] = []
        self._bins: list[_Bin] = []
        self._next_seq = 0

    def feed(self, tokens, lengths, source, doc_index):
        lengths = np.asarray(lengths, dtype=_I64)
        tokens = np.asarray(tokens, dtype=self.dtype)
        length = self.sample_length
        samples, offset = [], 0
        for n, index in zip(lengths.tolist(), np.asarray(doc_index).tolist()):
            doc = tokens[offset:offset + n]
            offset += n
            if n > length:
                self.stats.split_documents += 1
            full = n // length
            for k in range(full):  # whole windows of a long document go out at once, in order
                samples.append(_sample(doc[k * length:(k + 1) * length], [0], [source], [index]))
            tail = doc[full * length:]
            if len(tail):
                self._pending.append((tail, source, index))
                if len(self._pending) >= self.buffer_docs:
                    samples.extend(self._pack(self.max_open))
        return self._count(self._arrays(samples), lengths)

    def finish(self):
        samples = self._arrays(self._pack(0))
        self.stats.samples += samples.num_samples
        return samples

    def _pack(self, keep_open: int) -> list[Sample]:
        """Place the buffered pieces, then close full windows and all but `keep_open` partial ones."""
        length = self.sample_length
        free = sorted((length - b.used, b.seq) for b in self._bins)
        by_seq = {b.seq: b for b in self._bins}
        # Longest first; ties keep arrival order (sorted is stable), so the result is deterministic.
        for piece in sorted(self._pending, key=lambda p: -len(p[0])):
            n = len(piece[0])
            pos = bisect.bisect_left(free, (n, -1))
            if pos < len(free):
                room, seq = free.pop(pos)
            else:
                seq, room = self._next_seq, length
                self._next_seq += 1
                by_seq[seq] = _Bin(seq)
            target = by_seq[seq]
            target.pieces.append(piece)
            target.used += n
            bisect.insort(free, (room - n, seq))
        self._pending = []
        closing = {seq for room, seq in free if room == 0}
        partial = [(room, seq) for room, seq in free if room > 0]
        if len(partial) > keep_open:
            closing.update(seq for _, seq in partial[:len(partial) - keep_open])
        samples = [self._close(by_seq[seq]) for seq in sorted(closing)]
        self._bins = [by_seq[seq] for seq in sorted(by_seq) if seq not in closing]
        return samples

    def _close(self, target: _Bin) -> Sample:
        pad = self.sample_length - target.used
        parts = [p[0] for p in target.pieces]
        starts = np.zeros(len(parts), dtype=_I64)
        np.cumsum([len(p) for p in parts[:-1]], out=starts[1:])
        sources = [p[1] for p in target.pieces]
        indices = [p[2] for p in target.pieces]
        if pad:
            parts.append(np.full(pad, self.pad_id, dtype=self.dtype))
            starts = np.append(starts, target.used)
            sources.append(-1)
            indices.append(-1)
            self.stats.padding_tokens += pad
        return _sample(np.concatenate(parts), starts, sources, indices)

    def snapshot(self):
        pieces = [(*p, -1) for p in self._pending] + [(*p, b.seq) for b in self._bins for p in b.pieces]
        tokens = np.concatenate([p[0] for p in pieces]) if pieces else np.zeros(0, dtype=self.dtype)
        return {**super().snapshot(), "next_seq": self._next_seq, "piece_tokens": tokens,
                "piece_lengths": np.array([len(p[0]) for p in pieces], dtype=_I64),
                "piece_sources": np.array([p[1] for p in pieces], dtype=_I64),
                "piece_indices": np.array([p[2] for p in pieces], dtype=_I64),
                "piece_bins": np.array([p[3] for p in pieces], dtype=_I64)}

    def restore(self, state):
        super().restore(state)
        self._next_seq = int(state["next_seq"])
        tokens = np.asarray(state["piece_tokens"], dtype=self.dtype)
        self._pending, bins, offset = [], {}, 0
        for n, source, index, seq in zip(*(np.asarray(state[k]).tolist() for k in
                                           ("piece_lengths", "piece_sources", "piece_indices", "piece_bins"))):
            piece = (tokens[offset:offset + n], source, index)
            offset += n
            if seq < 0:
                self._pending.append(piece)
            else:
                target = bins.setdefault(seq, _Bin(seq))
                target.pieces.append(piece)
                target.used += n
        self._bins = [bins[seq] for seq in sorted(bins)]


def make_packer(mode: str, *, seq_len: int, pad_id: int, token_dtype: str, buffer_docs: int = 2048,
                max_open: int = 512) -> Packer:
    """The packer for `--pack MODE`; windows hold `seq_len + 1` tokens."""
    if mode == "concat":
        return ConcatPacker(seq_len + 1, pad_id, token_dtype)
    if mode == "bestfit":
        return BestFitPacker(seq_len + 1, pad_id, token_dtype, buffer_docs=buffer_docs, max_open=max_open)
    if mode == "none":
        return NonePacker(seq_len + 1, pad_id, token_dtype)
    raise ValueError(f"{option('pack')} must be one of {PACKING_MODES}, got {mode!r}")
