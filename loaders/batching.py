"""Turn global sample ids into batch arrays, reading held shards of the node-local cache.

Fixed-length (packed) data is gathered a whole chunk of batches at a time: one numpy fancy index
per shard into a [samples, length] mmap view, so the cost per batch is a few slices. Document
segment ids are built with one scatter and one cumsum per chunk.

Batch fields (numpy here, torch tensors in the dataset):
- `tokens`: [B, L] in the dataset's token dtype (uint16 or uint32). Packed data: L = seq_len + 1.
  Variable-length data: L = longest sample of the batch, padded with the tokenizer's pad id (else
  eos id, else 0), and `lengths` (int64 [B]) gives the real lengths.
- `sample_id`: int64 [B], global sample ids (streams of a mixture follow each other).
- `segment_ids`: int32 [B, L] when every shard stores document boundaries: the document segment
  number of each token, 0 for the first segment of every sample; -1 on padding (the padding
  segments bestfit packing writes, whose doc_source is -1, and the batch padding of variable-length data).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from shardkit.formats import ShardReader


# A `np.take` call costs about as much as copying this many bytes: below it, runs are too short.
_RUN_OVERHEAD_BYTES = 8192


class ShardTable:
    """Global sample ids <-> (shard, index in shard), over the shards of every stream in order."""

    def __init__(self, shard_sizes: Sequence[int]):
        # `sizes` may be a manifest's column itself (no copy); starts = ends - sizes, computed per lookup.
        self.sizes = np.asarray(shard_sizes, dtype=np.int64)
        self.ends = np.cumsum(self.sizes)

    def locate(self, sample_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        shard = np.searchsorted(self.ends, sample_ids, side="right")
        return shard, sample_ids - (self.ends[shard] - self.sizes[shard])


def group_rows(keys: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(key, row indices) for each distinct key, in order of first appearance."""
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    cuts = np.flatnonzero(np.diff(sorted_keys)) + 1
    groups = [(int(keys[g[0]]), g) for g in np.split(order, cuts)] if len(keys) else []
    groups.sort(key=lambda item: int(item[1][0]))
    return groups


def _segment_rows(reader: ShardReader, local: np.ndarray, rows: np.ndarray, out: np.ndarray,
                  padding: list[tuple[int, int, int]]) -> None:
    """Mark the first token of each non-first document segment of the given samples in `out`, and
    append (row, start, end) of every padding segment (doc_source -1, written by bestfit packing)."""
    arrays = reader.arrays
    d0 = arrays.doc_offsets[local]
    counts = arrays.doc_offsets[local + 1] - d0
    total = int(counts.sum())
    if total == 0:
        return
    row_of = np.repeat(rows, counts)
    segment = np.repeat(d0, counts) + np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    starts = arrays.doc_starts[segment]
    keep = starts > 0
    out[row_of[keep], starts[keep]] = 1
    for j in np.flatnonzero(arrays.doc_source[segment] < 0).tolist():  # rare: at most one per sample
        last = j + 1 == total or row_of[j + 1] != row_of[j]
        padding.append((int(row_of[j]), int(starts[j]), out.shape[1] if last else int(starts[j + 1])))


def _rows_view(reader: ShardReader, length: int) -> np.ndarray:
    """[samples, length] plain-ndarray view of a shard's tokens (np.memmap indexing is slower)."""
    tokens = reader.arrays.tokens
    if tokens.size != reader.num_samples * length:
        raise ValueError(f"shard {reader.name} does not hold fixed-length samples of {length} tokens")
    return tokens.view(np.ndarray).reshape(-1, length)


def gather_fixed(sample_ids: np.ndarray, *, table: ShardTable, reader_of: Callable[[int], ShardReader],
                 length: int, token_dtype: np.dtype, with_segments: bool) -> dict[str, np.ndarray]:
    """Tokens (and segment ids) of fixed-length samples, rows in the order of `sample_ids`.

    Callers sort the ids of each batch, so that each batch's rows form runs per shard: every run
    is then copied by one `np.take` from the shard's mmap straight into place (one copy, no scatter).
    """
    ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)
    shard, local = table.locate(ids)
    tokens = np.empty((len(ids), length), dtype=token_dtype)
    cuts = np.flatnonzero(np.diff(shard)) + 1
    views: dict[int, np.ndarray] = {}

    def view_of(index: int) -> np.ndarray:
        view = views.get(index)
        if view is None:
            view = views[index] = _rows_view(reader_of(index), length)
        return view

    # `local` is in range by construction (ShardTable, and the cache checked the shard's counts).
    if (len(cuts) + 1) * _RUN_OVERHEAD_BYTES < tokens.nbytes:
        bounds = [0, *cuts.tolist(), len(ids)]
        for start, end in zip(bounds[:-1], bounds[1:]):
            # mode="clip" lets numpy write straight into `out` (mode="raise" buffers a copy).
            np.take(view_of(int(shard[start])), local[start:end], axis=0, out=tokens[start:end], mode="clip")
    else:  # many short runs of small samples: one gather per shard and a scatter cost less
        for index, rows in group_rows(shard):
            tokens[rows] = np.take(view_of(index), local[rows], axis=0, mode="clip")
    out = {"tokens": tokens, "sample_id": ids}
    if with_segments:
        segments = np.zeros((len(ids), length), dtype=np.int32)
        padding: list[tuple[int, int, int]] = []
        for index, rows in group_rows(shard):
            _segment_rows(reader_of(index), local[rows], rows, segments, padding)
        np.cumsum(segments, axis=1, dtype=np.int32, out=segments)
        for row, start, end in padding:
            segments[row, start:end] = -1
        out["segment_ids"] = segments
    return out


def gather_variable(sample_ids: np.ndarray, *, table: ShardTable, reader_of: Callable[[int], ShardReader],
                    token_dtype: np.dtype, pad_id: int, with_segments: bool) -> dict[str, np.ndarray]:
    """One batch of variable-length samples, padded to the longest."""
    ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)
    shard, local = table.locate(ids)
    samples = [reader_of(int(s)).sample(int(i)) for s, i in zip(shard, local)]
    lengths = np.array([len(s.tokens) for s in samples], dtype=np.int64)
    width = max(int(lengths.max(initial=0)), 1)
    tokens = np.full((len(ids), width), pad_id, dtype=token_dtype)
    segments = np.full((len(ids), width), -1, dtype=np.int32) if with_segments else None
    for row, sample in enumerate(samples):
        n = len(sample.tokens)
        tokens[row, :n] = sample.tokens
        if segments is not None:
            marks = np.zeros(n, dtype=np.int32)
            starts = sample.doc_starts[sample.doc_starts > 0]
            marks[starts[starts < n]] = 1
            segments[row, :n] = np.cumsum(marks, dtype=np.int32)
    out = {"tokens": tokens, "sample_id": ids, "lengths": lengths}
    if segments is not None:
        out["segment_ids"] = segments
    return out
