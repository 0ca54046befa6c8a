"""Bounded zstd: a frame that would decompress past its declared size is refused before allocating."""

from __future__ import annotations

import pytest
from format_samples import build_tar

from shardkit.errors import CorruptShardError


def test_zstd_bomb_is_refused_before_allocation():
    import zstandard

    from shardkit.formats import decode_shard

    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))  # 64 MiB of zeros in a few KB
    data = build_tar([({"name": "000000000.tokens.npy.zst"}, bomb)])
    with pytest.raises(CorruptShardError, match="declares 67108864 decompressed bytes, more than the 1000 allowed"):
        decode_shard(data, shard_format="tar", token_dtype="uint16", shard="bomb.tar", raw_bytes=1000)
