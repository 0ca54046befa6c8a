"""Document boundaries of a batch: cu_seqlens (O(documents)) and the dense segment ids built from them."""

from __future__ import annotations

import numpy as np
import torch

from shardkit.loaders.sources.documents import boundaries, chunk_boundaries, dense_segment_ids, segment_starts


def test_cu_seqlens_and_dense_ids_match_a_token_by_token_walk():
    rng = np.random.default_rng(3)
    rows, length = 6, 40
    pieces = [(r, s, bool(rng.random() < 0.2)) for r in range(rows)
              for s in sorted(set(rng.integers(0, length, size=int(rng.integers(0, 5))).tolist()))]
    rng.shuffle(pieces)  # pieces come grouped by shard, not by row
    row, start, pad = (np.array(x) for x in zip(*pieces))
    keys, padding = segment_starts(row, start.astype(np.int64), pad.astype(bool), rows, length)
    batch = boundaries(keys, padding, rows, length)
    expected = np.empty((rows, length), dtype=np.int32)
    for r in range(rows):  # the definition, token by token
        starts = {s: p for rr, s, p in pieces if rr == r}
        segment, is_pad = -1, False
        for t in range(length):
            if t == 0 or t in starts:
                segment, is_pad = segment + 1, starts.get(t, False)
            expected[r, t] = -1 if is_pad else segment
    assert batch["cu_seqlens"][0] == 0 and batch["cu_seqlens"][-1] == rows * length
    assert np.all(np.diff(batch["cu_seqlens"]) > 0)
    dense = dense_segment_ids(torch.from_numpy(batch["cu_seqlens"]), torch.from_numpy(batch["padding_segments"]),
                              rows, length)
    np.testing.assert_array_equal(dense.numpy(), expected)


def test_chunk_boundaries_equal_each_batch_computed_on_its_own():
    rng = np.random.default_rng(5)
    rows, batch, length = 23, 4, 16  # the last batch holds 3 rows
    pieces = [(r, s, bool(rng.random() < 0.3)) for r in range(rows)
              for s in sorted(set(rng.integers(1, length, size=int(rng.integers(0, 4))).tolist()))]
    row, start, pad = (np.array(x) for x in zip(*pieces))
    chunk = chunk_boundaries(*segment_starts(row, start.astype(np.int64), pad.astype(bool), rows, length),
                             rows, batch, length)
    assert len(chunk) == 6
    for k, (cu, padding) in enumerate(chunk):
        mine = [(r - k * batch, s, p) for r, s, p in pieces if k * batch <= r < (k + 1) * batch]
        size = min(batch, rows - k * batch)
        r, s, p = (np.array(x, dtype=t) for x, t in zip(zip(*mine), (np.int64, np.int64, bool))) if mine else \
            (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, bool))
        expected = boundaries(*segment_starts(r, s, p, size, length), size, length)
        np.testing.assert_array_equal(cu, expected["cu_seqlens"])
        np.testing.assert_array_equal(padding, expected["padding_segments"])
        assert cu.dtype == np.int32 and padding.dtype == np.int32
