"""Turn global sample ids into batch arrays, reading held shards of the node-local cache.

Fixed-length (packed) data is gathered a whole chunk of batches at a time: one numpy fancy index
per shard into a [samples, length] mmap view, so the cost per batch is a few slices. Document
boundaries cost O(documents) per chunk (`shardkit.loaders.sources.documents`).

Batch fields (numpy here, torch tensors in the dataset):
- `tokens`: [B, L] in the dataset's token dtype (uint16 or uint32). Packed data: L = seq_len + 1.
  Variable-length data: L = longest sample of the batch, padded with the tokenizer's pad id (else
  eos id, else 0), and `lengths` (int64 [B]) gives the real lengths.
- `sample_id`: int64 [B], global sample ids (streams of a mixture follow each other).
- `cu_seqlens` (int32 [S + 1]) and `padding_segments` (int32 [P]) when every shard stores document
  boundaries: the batch's document segments over its flattened tokens, and which are padding (the
  padding segments bestfit packing writes, whose doc_source is -1, and the batch padding of
  variable-length data); see `shardkit.loaders.sources.documents`.
- `segment_ids`: int32 [B, L], only with `LoaderConfig.segment_ids=True`: the document segment number
  of each token, 0 for the first segment of every sample; -1 on padding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from shardkit.formats import ShardReader

from ..documents import boundaries, chunk_boundaries, dense_segment_ids, segment_starts


# A `np.take` call costs about as much as copying this many bytes: below it, runs are too short.
_RUN_OVERHEAD_BYTES = 8192


def group_rows(keys: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(key, row indices) for each distinct key, in order of first appearance."""
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    cuts = np.flatnonzero(np.diff(sorted_keys)) + 1
    groups = [(int(keys[g[0]]), g) for g in np.split(order, cuts)] if len(keys) else []
    groups.sort(key=lambda item: int(item[1][0]))
    return groups


def _pieces(reader: ShardReader, local: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, ...]:
    """(row, first token in the row, is padding) of every document piece of the given samples (O(pieces))."""
    arrays = reader.arrays
    d0 = arrays.doc_offsets[local]
    counts = arrays.doc_offsets[local + 1] - d0
    total = int(counts.sum())
    row_of = np.repeat(rows, counts)
    segment = np.repeat(d0, counts) + np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return row_of, arrays.doc_starts[segment].astype(np.int64), arrays.doc_source[segment] < 0


def _rows_view(reader: ShardReader, length: int) -> np.ndarray:
    """[samples, length] plain-ndarray view of a shard's tokens (np.memmap indexing is slower)."""
    tokens = reader.arrays.tokens
    if tokens.size != reader.num_samples * length:
        raise ValueError(f"shard {reader.name} does not hold fixed-length samples of {length} tokens")
    return tokens.view(np.ndarray).reshape(-1, length)


def gather_fixed(sample_ids: np.ndarray, *, table: ShardTable, reader_of: Callable[[int], ShardReader],
                 length: int, token_dtype: np.dtype, with_segments: bool, batch: int | None = None,
                 dense_segments: bool = False) -> list[dict[str, np.ndarray]]:
    """Batches of fixed-length samples (`batch` rows each; default: one batch of all), rows in the order of
    `sample_ids`, with their document boundaries when `with_segments` (`shardkit.loaders.sources.documents`).

    Callers sort the ids of each batch, so that each batch's rows form runs per shard: every run
    is then copied by one `np.take` from the shard's mmap straight into place (one copy, no scatter).
    """
    ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)
    batch = batch or len(ids)
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
        # A run per shard of each batch: the method, not `np.take`, and plain ints (a few per batch).
        for index, start, end in zip(shard[bounds[:-1]].tolist(), bounds[:-1], bounds[1:]):
            # mode="clip" lets numpy write straight into `out` (mode="raise" buffers a copy).
            view_of(index).take(local[start:end], axis=0, out=tokens[start:end], mode="clip")
    else:  # many short runs of small samples: one gather per shard and a scatter cost less
        for index, rows in group_rows(shard):
            tokens[rows] = np.take(view_of(index), local[rows], axis=0, mode="clip")
    starts = range(0, len(ids), batch)
    if not with_segments:
        return [{"tokens": tokens[b:b + batch], "sample_id": ids[b:b + batch]} for b in starts]
    pieces = [_pieces(reader_of(index), local[rows], rows) for index, rows in group_rows(shard)]
    keys, padding = segment_starts(*(np.concatenate(part) for part in zip(*pieces)), len(ids), length)
    out = [{"tokens": tokens[b:b + batch], "sample_id": ids[b:b + batch], "cu_seqlens": cu, "padding_segments": pad}
           for b, (cu, pad) in zip(starts, chunk_boundaries(keys, padding, len(ids), batch, length))]
    if dense_segments:
        for item in out:
            item["segment_ids"] = dense_segment_ids(torch.from_numpy(item["cu_seqlens"]),
                                                    torch.from_numpy(item["padding_segments"]),
                                                    len(item["sample_id"]), length).numpy()
    return out


def gather_variable(sample_ids: np.ndarray, *, table: ShardTable, reader_of: Callable[[int], ShardReader],
                    token_dtype: np.dtype, pad_id: int, with_segments: bool,
                    dense_segments: bool = False) -> dict[str, np.ndarray]:
    """One batch of variable-length samples, padded to the longest (each row's padding is a padding segment)."""
    ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)
    shard, local = table.locate(ids)
    samples = [reader_of(int(s)).sample(int(i)) for s, i in zip(shard, local)]
    lengths = np.array([len(s.tokens) for s in samples], dtype=np.int64)
    width = max(int(lengths.max(initial=0)), 1)
    tokens = np.full((len(ids), width), pad_id, dtype=token_dtype)
    for row, sample in enumerate(samples):
        tokens[row, :len(sample.tokens)] = sample.tokens
    out = {"tokens": tokens, "sample_id": ids, "lengths": lengths}
    if with_segments:
        starts = [np.asarray(s.doc_starts, dtype=np.int64) for s in samples]
        starts = [np.concatenate([d[(d > 0) & (d < n)], [n] if n < width else []]).astype(np.int64)
                  for d, n in zip(starts, lengths.tolist())]
        rows = np.repeat(np.arange(len(ids)), [len(d) for d in starts])
        flat = np.concatenate(starts) if starts else np.zeros(0, dtype=np.int64)
        keys, padding = segment_starts(rows, flat, flat == lengths[rows], len(ids), width)
        out.update(boundaries(keys, padding, len(ids), width))
        if dense_segments:
            out["segment_ids"] = dense_segment_ids(torch.from_numpy(out["cu_seqlens"]),
                                                   torch.from_numpy(out["padding_segments"]), len(ids), width).numpy()
    return out
