"""One batch of raw-text samples as the arrays built batches carry (`shardkit.loaders.sources.built.batching`).

- `tokens` [B, L]: packed samples are L = seq_len + 1 tokens; with pack="none" L is the longest sample of the
  batch, padded with the pad id, and `lengths` (int64 [B]) gives the real lengths.
- `sample_id` int64 [B]: the sample's global position (lane = id % lanes, index in the lane = id // lanes,
  until a lane runs dry: `order.lanes.position_lanes`), the same whatever the world size, batch size or workers.
- `lane_epoch` int64 [B]: the lane epoch the sample belongs to.
- `cu_seqlens`, `padding_segments`: the batch's document segments (`shardkit.loaders.sources.documents`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from shardkit.formats import Sample

from ..documents import boundaries, dense_segment_ids, segment_starts

CURSORS_KEY = "_raw_lane_cursors"  # [lanes touched, 8]: lane, then its cursor after this batch (the loader's)
UNREADABLE_KEY = "_raw_unreadable"  # the units this batch's readers found unreadable (`sources.raw.unreadable.Unreadable`)
DRY_KEY = "_raw_dry_lanes"  # the lanes this batch's readers found dry (`sources.raw.dry_lanes.DryLane`)


def raw_batch(samples: Sequence[Sample], positions: np.ndarray, epochs: Sequence[int], *, pad_id: int,
              token_dtype: str, variable: bool, dense_segments: bool = False) -> dict[str, np.ndarray]:
    """The batch of `samples` (one row each), ids `positions`, from lane epochs `epochs`.

    Built with a few array operations over the batch rather than per row: for cheap tokenizers this assembly is
    a large part of the loader's work per token."""
    count = len(samples)
    full = _full_rows(samples, token_dtype) if count else None
    if full is not None:  # the common case, a few array operations: packed rows whose segments are known
        tokens, segments = full
        lengths = np.full(count, tokens.shape[1], dtype=np.int64)
    else:
        lengths = np.fromiter((len(s.tokens) for s in samples), dtype=np.int64, count=count)
        tokens, segments = _any_rows(samples, lengths, pad_id, token_dtype)
    out = {"tokens": tokens, "sample_id": np.asarray(positions, dtype=np.int64),
           "lane_epoch": np.asarray(epochs, dtype=np.int64)}
    if variable:
        out["lengths"] = lengths
    out.update(segments)
    if dense_segments:
        out["segment_ids"] = dense_segment_ids(torch.from_numpy(out["cu_seqlens"]),
                                               torch.from_numpy(out["padding_segments"]), *tokens.shape).numpy()
    return out


def _full_rows(samples: Sequence[Sample], token_dtype: str) -> tuple[np.ndarray, dict[str, np.ndarray]] | None:
    """The tokens, `cu_seqlens` and `padding_segments` of rows of one length whose segments' lengths the
    lanes worked out (`segment_samples.LaneSample.segment_lengths`: no padding segment), or None.

    `cu_seqlens` is then the running sum of the rows' segment lengths, in their order: what `segment_starts`
    finds by sorting the segments' flat offsets."""
    pieces = [getattr(s, "segment_lengths", None) for s in samples]
    width = len(samples[0].tokens)
    if any(p is None for p in pieces) or any(len(s.tokens) != width for s in samples):
        return None
    tokens = np.concatenate([s.tokens for s in samples]).reshape(len(samples), width)
    lengths = np.concatenate(pieces)
    cu = np.empty(len(lengths) + 1, dtype=np.int32)
    cu[0] = 0
    np.cumsum(lengths, out=cu[1:])
    return tokens.astype(token_dtype, copy=False), {"cu_seqlens": cu, "padding_segments": np.empty(0, np.int32)}


def _any_rows(samples: Sequence[Sample], lengths: np.ndarray, pad_id: int, token_dtype: str
              ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The tokens of rows of any lengths and segments, padded to the longest with `pad_id` (a padding segment
    each), and their `cu_seqlens` and `padding_segments`."""
    count = len(samples)
    width = max(int(lengths.max(initial=0)), 1)
    if count and (lengths == width).all():  # packed samples: all of one length
        tokens = np.stack([s.tokens for s in samples]).astype(token_dtype, copy=False)
    else:
        tokens = np.full((count, width), pad_id, dtype=token_dtype)
        for row, sample in enumerate(samples):
            tokens[row, :len(sample.tokens)] = sample.tokens
    pieces = np.fromiter((len(s.doc_starts) for s in samples), dtype=np.int64, count=count)
    short = np.flatnonzero(lengths < width)  # rows padded at their tail: a padding segment each
    rows = np.concatenate([np.repeat(np.arange(count, dtype=np.int64), pieces), short])
    starts = np.concatenate([*(s.doc_starts for s in samples), lengths[short]]).astype(np.int64, copy=False)
    padding = np.concatenate([np.concatenate([s.doc_source for s in samples]) < 0 if count else np.zeros(0, bool),
                              np.ones(len(short), dtype=bool)])
    keys, flags = segment_starts(rows, starts, padding, count, width)
    return tokens, boundaries(keys, flags, count, width)
