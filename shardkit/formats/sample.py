"""In-memory shapes of shard contents: one `Sample`, and `ShardArrays` (a whole shard as flat arrays).

Document boundaries are stored per sample as parallel arrays over the document *segments* a sample
holds: `doc_starts[j]` is where segment j begins inside the sample's tokens (the first is 0),
`doc_source[j]` indexes the manifest's `sources` (-1 marks padding) and `doc_index[j]` is the
document's index inside that source.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from shardkit.errors import CorruptShardError

TOKEN_NUMPY_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
DOC_STARTS_DTYPE = np.dtype("<i4")
DOC_SOURCE_DTYPE = np.dtype("<i4")
DOC_INDEX_DTYPE = np.dtype("<i8")
OFFSETS_DTYPE = np.dtype("<i8")


def numpy_token_dtype(token_dtype: str) -> np.dtype:
    try:
        return TOKEN_NUMPY_DTYPES[token_dtype]
    except KeyError:
        raise ValueError(f"token_dtype must be 'uint16' or 'uint32', got {token_dtype!r}") from None


@dataclass(frozen=True)
class Sample:
    """One training sample: its token ids and, optionally, its document segments.

    The three segment arrays go together (all or none), one entry per document segment the sample holds.

    Attributes:
        tokens: the token ids (a 1-D integer array; packed samples hold seq_len + 1 tokens).
        doc_starts: where each segment begins inside `tokens` (the first is 0), or None.
        doc_source: per segment, the index into the manifest's `sources` (-1 marks padding), or None.
        doc_index: per segment, the document's index inside its source (line, row or paragraph), or None.
    """

    tokens: np.ndarray
    doc_starts: np.ndarray | None = None
    doc_source: np.ndarray | None = None
    doc_index: np.ndarray | None = None

    @property
    def has_doc_boundaries(self) -> bool:
        """Whether the sample stores its document segments."""
        return self.doc_starts is not None


@dataclass(frozen=True)
class ShardArrays:
    """A whole shard as flat arrays (zero-copy views when they come from a decoded cache file).

    Sample i is `tokens[sample_offsets[i]:sample_offsets[i+1]]`; its segments are entries
    `doc_offsets[i]:doc_offsets[i+1]` of the three doc arrays (all None when not stored).
    """

    tokens: np.ndarray
    sample_offsets: np.ndarray
    doc_offsets: np.ndarray | None = None
    doc_starts: np.ndarray | None = None
    doc_source: np.ndarray | None = None
    doc_index: np.ndarray | None = None

    @property
    def num_samples(self) -> int:
        return len(self.sample_offsets) - 1

    @property
    def has_doc_boundaries(self) -> bool:
        return self.doc_offsets is not None

    @property
    def raw_nbytes(self) -> int:
        return sum(a.nbytes for a in (self.tokens, self.sample_offsets, self.doc_offsets,
                                      self.doc_starts, self.doc_source, self.doc_index) if a is not None)

    def __iter__(self) -> Iterator[Sample]:
        return (self.sample(i) for i in range(self.num_samples))

    def slice(self, start: int, stop: int) -> ShardArrays:
        """Samples [start, stop) as arrays of their own (offsets rebased to 0; token and segment arrays are
        views)."""
        t0, t1 = int(self.sample_offsets[start]), int(self.sample_offsets[stop])
        offsets = self.sample_offsets[start:stop + 1] - t0
        if self.doc_offsets is None:
            return ShardArrays(self.tokens[t0:t1], offsets)
        d0, d1 = int(self.doc_offsets[start]), int(self.doc_offsets[stop])
        return ShardArrays(self.tokens[t0:t1], offsets, self.doc_offsets[start:stop + 1] - d0,
                           self.doc_starts[d0:d1], self.doc_source[d0:d1], self.doc_index[d0:d1])

    def sample(self, i: int) -> Sample:
        start, end = int(self.sample_offsets[i]), int(self.sample_offsets[i + 1])
        tokens = self.tokens[start:end]
        if self.doc_offsets is None:
            return Sample(tokens)
        d0, d1 = int(self.doc_offsets[i]), int(self.doc_offsets[i + 1])
        return Sample(tokens, self.doc_starts[d0:d1], self.doc_source[d0:d1], self.doc_index[d0:d1])

    def validate(self, name: str) -> None:
        """Check the structural invariants; raise `CorruptShardError` naming `name` if any fails."""
        offsets = self.sample_offsets
        if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(self.tokens):
            raise CorruptShardError(name, "sample offsets do not cover the token array")
        if np.any(np.diff(offsets) < 0):
            raise CorruptShardError(name, "sample offsets decrease")
        if self.doc_offsets is None:
            if any(a is not None for a in (self.doc_starts, self.doc_source, self.doc_index)):
                raise CorruptShardError(name, "document arrays present without document offsets")
            return
        doc_offsets = self.doc_offsets
        n_docs = doc_offsets[-1] if len(doc_offsets) else 0
        if (len(doc_offsets) != len(offsets) or doc_offsets[0] != 0
                or any(a is None or len(a) != n_docs for a in (self.doc_starts, self.doc_source, self.doc_index))):
            raise CorruptShardError(name, "document arrays do not line up with the samples")
        if np.any(np.diff(doc_offsets) < 0):
            raise CorruptShardError(name, "document offsets decrease")
        lengths = np.diff(offsets)
        seg_counts = np.diff(doc_offsets)
        # A non-empty sample has at least one segment, and its first segment starts at 0.
        if np.any((lengths > 0) & (seg_counts == 0)):
            raise CorruptShardError(name, "a non-empty sample has no document segment")
        if n_docs:
            owner = np.repeat(np.arange(len(lengths)), seg_counts)
            starts = self.doc_starts.astype(np.int64)
            first = np.zeros(n_docs, dtype=bool)
            first[doc_offsets[:-1][seg_counts > 0]] = True
            if np.any(starts[first] != 0):
                raise CorruptShardError(name, "a sample's first document segment does not start at 0")
            if np.any((starts < 0) | (starts >= np.maximum(lengths[owner], 1))):
                raise CorruptShardError(name, "a document segment starts outside its sample")
            if np.any(np.diff(starts)[~first[1:]] <= 0):
                raise CorruptShardError(name, "document segment starts are not increasing within a sample")


def _checked_tokens(tokens, token_dtype: str, *, what: str) -> np.ndarray:
    """`tokens` as a 1-D array of `token_dtype`, refused when an id does not fit it."""
    dtype = numpy_token_dtype(token_dtype)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"{what}: tokens must be 1-D, got shape {tokens.shape}")
    if tokens.dtype != dtype:
        if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
            raise TypeError(f"{what}: tokens must be integers, got {tokens.dtype}")
        limit = np.iinfo(dtype).max
        if tokens.size and (tokens.min() < 0 or tokens.max() > limit):
            raise ValueError(f"{what}: token ids must be in [0, {limit}] for {token_dtype}")
    return tokens.astype(dtype, copy=False)


def check_sample(sample: Sample, token_dtype: str, *, what: str = "sample") -> Sample:
    """Validate one sample and return it with tokens in `token_dtype` (doc arrays in their dtypes).

    `ShardWriter.write` calls this so a bad sample fails at once, naming it, instead of when its
    shard is flushed (and without keeping int64 inputs in the buffer at 4x the size).

    Raises:
        ValueError: non-1-D tokens, ids outside the dtype, or inconsistent document segments.
        TypeError: non-integer tokens.
    """
    tokens = _checked_tokens(sample.tokens, token_dtype, what=what)
    if not sample.has_doc_boundaries:
        if sample.doc_source is not None or sample.doc_index is not None:
            raise ValueError(f"{what}: doc_source/doc_index given without doc_starts")
        return Sample(tokens)
    parts = [np.asarray(a) for a in (sample.doc_starts, sample.doc_source, sample.doc_index)]
    if any(p.ndim != 1 or len(p) != len(parts[0]) for p in parts):
        raise ValueError(f"{what}: doc_starts, doc_source and doc_index must be 1-D of equal length")
    starts = parts[0].astype(np.int64)
    if tokens.size and (len(starts) == 0 or starts[0] != 0 or np.any(np.diff(starts) <= 0)
                        or starts[-1] >= tokens.size):
        raise ValueError(f"{what}: doc_starts must begin at 0 and increase strictly inside the sample's "
                         f"{tokens.size} tokens")
    if not tokens.size and len(starts):
        raise ValueError(f"{what}: an empty sample cannot have document segments")
    if len(starts) and int(parts[1].min()) < -1:
        raise ValueError(f"{what}: doc_source must be >= -1 (-1 marks padding)")
    return Sample(tokens, parts[0].astype(DOC_STARTS_DTYPE), parts[1].astype(DOC_SOURCE_DTYPE),
                  parts[2].astype(DOC_INDEX_DTYPE))


def arrays_from_samples(samples: Sequence[Sample], token_dtype: str) -> ShardArrays:
    """Pack samples into flat arrays, checking token range and document-array consistency."""
    dtype = numpy_token_dtype(token_dtype)
    limit = np.iinfo(dtype).max
    with_docs = {s.has_doc_boundaries for s in samples}
    if len(with_docs) > 1:
        raise ValueError("all samples of a shard must either store document boundaries or not")
    has_docs = with_docs == {True}
    token_parts, lengths = [], np.zeros(len(samples), dtype=np.int64)
    for i, sample in enumerate(samples):
        tokens = np.asarray(sample.tokens)
        if tokens.ndim != 1:
            raise ValueError(f"sample {i}: tokens must be 1-D, got shape {tokens.shape}")
        if tokens.size and tokens.dtype != dtype:
            if not np.issubdtype(tokens.dtype, np.integer):
                raise TypeError(f"sample {i}: tokens must be integers, got {tokens.dtype}")
            if tokens.min() < 0 or tokens.max() > limit:
                raise ValueError(f"sample {i}: token ids must be in [0, {limit}] for {token_dtype}")
        token_parts.append(tokens.astype(dtype, copy=False))
        lengths[i] = tokens.size
    offsets = np.zeros(len(samples) + 1, dtype=OFFSETS_DTYPE)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate(token_parts) if token_parts else np.zeros(0, dtype=dtype)
    if not has_docs:
        return ShardArrays(tokens, offsets)
    starts, sources, indices, counts = [], [], [], np.zeros(len(samples), dtype=np.int64)
    for i, sample in enumerate(samples):
        parts = [np.asarray(a) for a in (sample.doc_starts, sample.doc_source, sample.doc_index)]
        if any(p.ndim != 1 or len(p) != len(parts[0]) for p in parts):
            raise ValueError(f"sample {i}: doc_starts, doc_source and doc_index must be 1-D of equal length")
        starts.append(parts[0].astype(DOC_STARTS_DTYPE))
        sources.append(parts[1].astype(DOC_SOURCE_DTYPE))
        indices.append(parts[2].astype(DOC_INDEX_DTYPE))
        counts[i] = len(parts[0])
    doc_offsets = np.zeros(len(samples) + 1, dtype=OFFSETS_DTYPE)
    np.cumsum(counts, out=doc_offsets[1:])
    arrays = ShardArrays(
        tokens, offsets, doc_offsets,
        np.concatenate(starts) if starts else np.zeros(0, DOC_STARTS_DTYPE),
        np.concatenate(sources) if sources else np.zeros(0, DOC_SOURCE_DTYPE),
        np.concatenate(indices) if indices else np.zeros(0, DOC_INDEX_DTYPE),
    )
    try:
        arrays.validate("<being written>")
    except CorruptShardError as err:
        raise ValueError(f"invalid document boundaries: {err.reason}") from None
    return arrays


def empty_arrays(token_dtype: str) -> ShardArrays:
    """A shard of no samples."""
    return ShardArrays(np.zeros(0, dtype=numpy_token_dtype(token_dtype)), np.zeros(1, dtype=OFFSETS_DTYPE))


def concat_arrays(parts: Sequence[ShardArrays], token_dtype: str) -> ShardArrays:
    """The samples of `parts`, in order, as one `ShardArrays` (all parts with document boundaries, or none;
    the same arrays `arrays_from_samples` makes of the parts' samples)."""
    parts = [p for p in parts if p.num_samples]
    if not parts:
        return empty_arrays(token_dtype)
    if len({p.has_doc_boundaries for p in parts}) > 1:
        raise ValueError("all samples of a shard must either store document boundaries or not")

    def offsets(arrays: list[np.ndarray]) -> np.ndarray:
        out = np.zeros(1 + sum(len(a) - 1 for a in arrays), dtype=OFFSETS_DTYPE)
        np.cumsum(np.concatenate([np.diff(a) for a in arrays]), out=out[1:])
        return out

    tokens = np.concatenate([p.tokens for p in parts]).astype(numpy_token_dtype(token_dtype), copy=False)
    if not parts[0].has_doc_boundaries:
        return ShardArrays(tokens, offsets([p.sample_offsets for p in parts]))
    return ShardArrays(tokens, offsets([p.sample_offsets for p in parts]), offsets([p.doc_offsets for p in parts]),
                       *(np.concatenate([getattr(p, name) for p in parts]).astype(kind, copy=False)
                         for name, kind in (("doc_starts", DOC_STARTS_DTYPE), ("doc_source", DOC_SOURCE_DTYPE),
                                            ("doc_index", DOC_INDEX_DTYPE))))


def check_arrays(arrays: ShardArrays, token_dtype: str, *, what: str) -> ShardArrays:
    """`check_sample` for a run of samples at once: the arrays with tokens in `token_dtype` and the segment
    arrays in their dtypes.

    Raises:
        ValueError: ids outside the dtype, or inconsistent offsets or document segments (names `what`).
        TypeError: non-integer tokens.
    """
    tokens = _checked_tokens(arrays.tokens, token_dtype, what=what)
    offsets = np.asarray(arrays.sample_offsets).astype(OFFSETS_DTYPE, copy=False)
    if arrays.has_doc_boundaries:
        checked = ShardArrays(tokens, offsets,
                              np.asarray(arrays.doc_offsets).astype(OFFSETS_DTYPE, copy=False),
                              np.asarray(arrays.doc_starts).astype(DOC_STARTS_DTYPE, copy=False),
                              np.asarray(arrays.doc_source).astype(DOC_SOURCE_DTYPE, copy=False),
                              np.asarray(arrays.doc_index).astype(DOC_INDEX_DTYPE, copy=False))
    else:
        checked = ShardArrays(tokens, offsets)
    try:
        checked.validate(what)
    except CorruptShardError as err:
        raise ValueError(f"{what}: {err.reason}") from None
    if checked.has_doc_boundaries:
        empty = np.diff(checked.sample_offsets) == 0
        if np.any(empty & (np.diff(checked.doc_offsets) > 0)):
            raise ValueError(f"{what}: an empty sample cannot have document segments")
        if len(checked.doc_source) and int(checked.doc_source.min()) < -1:
            raise ValueError(f"{what}: doc_source must be >= -1 (-1 marks padding)")
    return checked
