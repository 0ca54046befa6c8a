"""Dispatch between the shard formats: bytes <-> `ShardArrays`, with hashing."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from shardkit.errors import CorruptShardError
from shardkit.formats.arrow_format import decode_arrow, encode_arrow
from shardkit.formats.sample import ShardArrays
from shardkit.formats.tar_format import decode_tar, encode_tar

SHARD_EXTENSIONS = {"tar": ".tar", "arrow": ".arrow"}


@dataclass(frozen=True)
class EncodedShard:
    """A serialised shard and the facts the manifest records about it."""

    data: bytes
    samples: int
    tokens: int
    raw_bytes: int
    sha256: str
    has_doc_boundaries: bool


def encode_shard(arrays: ShardArrays, *, shard_format: str, token_dtype: str, level: int = 3) -> EncodedShard:
    if shard_format == "tar":
        data, raw = encode_tar(arrays, level=level)
    elif shard_format == "arrow":
        data, raw = encode_arrow(arrays, token_dtype=token_dtype, level=level)
    else:
        raise ValueError(f"shard_format must be 'tar' or 'arrow', got {shard_format!r}")
    return EncodedShard(data, arrays.num_samples, int(arrays.tokens.size), raw,
                        hashlib.sha256(data).hexdigest(), arrays.has_doc_boundaries)


def decode_shard(data: bytes | memoryview, *, shard_format: str, token_dtype: str, shard: str, raw_bytes: int) -> ShardArrays:
    """Decode shard bytes; `raw_bytes` from the manifest bounds decompression and must match exactly."""
    if shard_format == "tar":
        return decode_tar(data, token_dtype=token_dtype, shard=shard, raw_bytes=raw_bytes)
    if shard_format == "arrow":
        return decode_arrow(data, token_dtype=token_dtype, shard=shard, raw_bytes=raw_bytes)
    raise ValueError(f"shard_format must be 'tar' or 'arrow', got {shard_format!r}")


def check_shard_bytes(data: bytes | memoryview, *, shard: str, sha256: str, size: int) -> None:
    """Raise `CorruptShardError` unless `data` has the manifest's size and SHA-256."""
    if len(data) != size:
        raise CorruptShardError(shard, f"size is {len(data)} bytes, the manifest says {size} (truncated or replaced)")
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise CorruptShardError(shard, f"sha256 is {digest}, the manifest says {sha256}")
