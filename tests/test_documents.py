"""Document boundaries of a batch: cu_seqlens (O(documents)) and the dense segment ids built from them."""

from __future__ import annotations

import numpy as np
import torch

from shardkit.loaders.documents import boundaries, dense_segment_ids, segment_starts


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
