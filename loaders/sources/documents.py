"""Document boundaries of a batch: cumulative sequence lengths, and dense segment ids built from them.

A batch whose shards store document boundaries carries them in the form attention kernels take
(`flash_attn_varlen_func`'s `cu_seqlens`, PyTorch's nested/jagged layouts), O(documents) per batch:

- `cu_seqlens`: int32 [S + 1], the offsets of the batch's S segments in its tokens flattened row by
  row ([B, L] -> B x L), from 0 to B x L. Every row starts a segment; a new document inside a row starts
  another. Segment k is tokens `cu_seqlens[k]:cu_seqlens[k + 1]` of the flattened batch.
- `padding_segments`: int32 [P], the indices of the segments that are padding (bestfit packing's filler,
  a variable-length batch's tail), whose tokens are never targets. Empty for most batches.

Dense per-token `segment_ids` ([B, L], the document number inside its row, -1 on padding) cost a
cumulative sum over every token: the largest cost of a warm epoch on real text. They are built only on
request, by `dense_segment_ids`, in the loader (`LoaderConfig.segment_ids=True`) or by the consumer on
its device (the trainer does this).
"""

from __future__ import annotations

import numpy as np
import torch


def boundaries(keys: np.ndarray, padding: np.ndarray, rows: int, length: int) -> dict[str, np.ndarray]:
    """`cu_seqlens` and `padding_segments` of one batch from its segments' flat start offsets.

    Args:
        keys: sorted unique start offsets (row x length + start in row) of every segment, including
            each row's offset `row x length`.
        padding: the indices of the padding segments (or a bool per segment, True for padding).
        rows, length: the batch's shape.
    """
    cu = np.empty(len(keys) + 1, dtype=np.int32)
    cu[:-1] = keys
    cu[-1] = rows * length
    padding = np.flatnonzero(padding) if padding.dtype == bool else padding
    return {"cu_seqlens": cu, "padding_segments": padding.astype(np.int32)}


def chunk_boundaries(keys: np.ndarray, padding: np.ndarray, num_rows: int, batch: int,
                     length: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(`cu_seqlens`, `padding_segments`) of each batch of `batch` rows (the last may have fewer) of a chunk of
    `num_rows` rows, computed for the whole chunk at once: each batch's arrays are views of two arrays, so a
    batch costs two slices, not a pass of its own (the warm path's per-batch Python).

    Args:
        keys: sorted unique flat start offsets (row x length + start in row) of the chunk's segments,
            including each row's offset (`segment_starts`).
        padding: a bool per segment, True for padding.
        num_rows, batch, length: the chunk's rows, rows per batch, tokens per row.
    """
    span = batch * length
    num_batches = -(-num_rows // batch)
    numbers = np.arange(num_batches, dtype=np.int64)
    # edges[k]: the first segment of batch k (every row starts a segment, so each batch has at least one).
    edges = np.searchsorted(keys, np.arange(num_batches + 1, dtype=np.int64) * span)
    batch_of = np.repeat(numbers, np.diff(edges))
    # One array holding every batch's cu_seqlens in turn: batch k's segments shifted by the k terminal
    # entries before them, then its own terminal (its rows x length).
    cu = np.empty(len(keys) + num_batches, dtype=np.int32)
    cu[np.arange(len(keys), dtype=np.int64) + batch_of] = keys - batch_of * span
    cu[edges[1:] + numbers] = np.minimum(batch, num_rows - numbers * batch) * length
    padded = np.flatnonzero(padding)  # segment indices over the chunk; usually none
    padded_edges = np.searchsorted(padded, edges).tolist()
    padded = (padded - edges[batch_of[padded]]).astype(np.int32)
    starts, ends = (edges[:-1] + numbers).tolist(), (edges[1:] + numbers + 1).tolist()
    return [(cu[s:e], padded[p:q]) for s, e, p, q in zip(starts, ends, padded_edges[:-1], padded_edges[1:])]


def segment_starts(rows: np.ndarray, starts: np.ndarray, padding: np.ndarray, num_rows: int,
                   length: int) -> tuple[np.ndarray, np.ndarray]:
    """(sorted unique flat start offsets, padding flag of each) of the segments of `num_rows` rows.

    `rows`, `starts`, `padding`: one entry per document piece (its row, its first token in the row, and
    whether it is padding), in any order; every row gets a segment at its offset 0 in addition.
    """
    keys = np.concatenate([rows.astype(np.int64) * length + starts,
                           np.arange(num_rows, dtype=np.int64) * length])
    flags = np.concatenate([padding, np.zeros(num_rows, dtype=bool)])
    order = np.argsort(keys, kind="stable")  # a piece sorts before its row's own start entry
    keys, flags = keys[order], flags[order]
    first = np.ones(len(keys), dtype=bool)
    first[1:] = keys[1:] != keys[:-1]
    return keys[first], flags[first]


def dense_segment_ids(cu_seqlens: torch.Tensor, padding_segments: torch.Tensor, rows: int,
                      length: int) -> torch.Tensor:
    """Per-token segment ids int32 [rows, length] (0 for each row's first segment, -1 on padding) from a
    batch's `cu_seqlens` and `padding_segments`, on their device."""
    starts = cu_seqlens[:-1].to(torch.int64)
    positions = torch.arange(rows * length, device=cu_seqlens.device)
    segment = torch.searchsorted(starts, positions, right=True) - 1
    row_first = torch.searchsorted(starts, torch.arange(rows, device=cu_seqlens.device) * length)
    ids = (segment.view(rows, length) - row_first[:, None]).to(torch.int32)
    if padding_segments.numel():
        is_padding = torch.zeros(len(starts), dtype=torch.bool, device=cu_seqlens.device)
        is_padding[padding_segments.to(torch.int64)] = True
        ids = ids.masked_fill(is_padding[segment].view(rows, length), -1)
    return ids
