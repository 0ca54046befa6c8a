"""Decoded cache files (.skd): broken or foreign files are refused."""

from __future__ import annotations

import numpy as np
import pytest

from shardkit.errors import CorruptShardError
from shardkit.formats import Sample, open_decoded, write_decoded


def test_broken_decoded_cache_files_are_rejected(tmp_path):
    from shardkit.formats import arrays_from_samples

    path = tmp_path / "cache.decoded"
    write_decoded(str(path), arrays_from_samples([Sample(np.arange(100))] * 4, "uint16"))
    good = path.read_bytes()
    path.write_bytes(good[: len(good) - 300])
    with pytest.raises(CorruptShardError, match="s1: .*lies outside the file"):
        open_decoded(str(path), shard="s1")
    path.write_bytes(b"NOTSHARD" + good[8:])
    with pytest.raises(CorruptShardError, match="not a shardkit decoded-shard file"):
        open_decoded(str(path), shard="s1")
    path.write_bytes(good[:10])
    with pytest.raises(CorruptShardError, match="truncated"):
        open_decoded(str(path), shard="s1")
