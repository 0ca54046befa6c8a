"""`ShardTable`: global sample ids <-> (shard, index in shard), over the shards of every stream in order (pure:
the one sample-to-shard lookup of the read side)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class ShardTable:
    """Global sample ids <-> (shard, index in shard), over the shards of every stream in order."""

    def __init__(self, shard_sizes: Sequence[int]):
        # `sizes` may be a manifest's column itself (no copy); starts = ends - sizes, computed per lookup.
        self.sizes = np.asarray(shard_sizes, dtype=np.int64)
        self.ends = np.cumsum(self.sizes)

    @classmethod
    def of_streams(cls, shard_sizes: Sequence[Sequence[int]]) -> ShardTable:
        """The table over several streams' shards, numbered in stream order (each stream's samples per shard)."""
        if len(shard_sizes) == 1:
            return cls(shard_sizes[0])  # a manifest's column itself, not a copy
        return cls(np.concatenate(shard_sizes) if len(shard_sizes) else np.zeros(0, dtype=np.int64))

    def locate(self, sample_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        shard = np.searchsorted(self.ends, sample_ids, side="right")
        return shard, sample_ids - (self.ends[shard] - self.sizes[shard])
