"""One batch of raw-text samples as the arrays built batches carry (`shardkit.loaders.sources.built.batching`).

- `tokens` [B, L]: packed samples are L = seq_len + 1 tokens; with pack="none" L is the longest sample of the
  batch, padded with the pad id, and `lengths` (int64 [B]) gives the real lengths.
- `sample_id` int64 [B]: the sample's global position (lane = id % lanes, index in the lane = id // lanes),
  the same whatever the world size, batch size or workers.
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


def raw_batch(samples: Sequence[Sample], positions: np.ndarray, epochs: Sequence[int], *, pad_id: int,
              token_dtype: str, variable: bool, dense_segments: bool = False) -> dict[str, np.ndarray]:
    """The batch of `samples` (one row each), ids `positions`, from lane epochs `epochs`."""
    lengths = np.array([len(s.tokens) for s in samples], dtype=np.int64)
    width = max(int(lengths.max(initial=0)), 1)
    tokens = np.full((len(samples), width), pad_id, dtype=token_dtype)
    rows, starts, padding = [], [], []
    for row, sample in enumerate(samples):
        n = len(sample.tokens)
        tokens[row, :n] = sample.tokens
        doc_starts = np.asarray(sample.doc_starts, dtype=np.int64)
        rows.append(np.full(len(doc_starts) + (n < width), row, dtype=np.int64))
        starts.append(np.concatenate([doc_starts, [n]] if n < width else [doc_starts]))
        padding.append(np.concatenate([np.asarray(sample.doc_source) < 0, [True]] if n < width
                                      else [np.asarray(sample.doc_source) < 0]))
    out = {"tokens": tokens, "sample_id": np.asarray(positions, dtype=np.int64),
           "lane_epoch": np.asarray(epochs, dtype=np.int64)}
    if variable:
        out["lengths"] = lengths
    keys, flags = segment_starts(np.concatenate(rows), np.concatenate(starts), np.concatenate(padding),
                                 len(samples), width)
    out.update(boundaries(keys, flags, len(samples), width))
    if dense_segments:
        out["segment_ids"] = dense_segment_ids(torch.from_numpy(out["cu_seqlens"]),
                                               torch.from_numpy(out["padding_segments"]), len(samples), width).numpy()
    return out
