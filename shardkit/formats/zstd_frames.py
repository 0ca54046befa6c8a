"""zstd with bounds: every decompression is capped, so a corrupt or hostile frame (a "zstd bomb")
can never make shardkit allocate more than the manifest says the payload holds."""

from __future__ import annotations

import io

import zstandard

from shardkit.errors import CorruptShardError


def compressor(level: int) -> zstandard.ZstdCompressor:
    # Frame checksums make zstd itself detect flipped bytes on decompression.
    return zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)


def decompress_bounded(data: bytes | memoryview, *, limit: int, shard: str, what: str,
                       decompressor: zstandard.ZstdDecompressor | None = None) -> bytes:
    """Decompress one zstd frame whose output must not exceed `limit` bytes.

    Pass a `decompressor` when decompressing many small frames in one thread (a tar shard holds one
    per sample): creating a zstd context per frame costs more than decompressing a 4 KB member.
    """
    dctx = decompressor or zstandard.ZstdDecompressor()
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as err:
        raise CorruptShardError(shard, f"{what}: not a zstd frame ({err})") from err
    if declared > limit:
        raise CorruptShardError(shard, f"{what}: declares {declared} decompressed bytes, more than the {limit} allowed")
    try:
        if declared >= 0:
            out = dctx.decompress(data, max_output_size=declared)
        else:  # no declared size: stream, reading at most limit + 1 bytes
            with dctx.stream_reader(io.BytesIO(bytes(data)), read_across_frames=False) as reader:
                out = reader.read(limit + 1)
    except zstandard.ZstdError as err:
        raise CorruptShardError(shard, f"{what}: zstd decompression failed ({err})") from err
    if len(out) > limit:
        raise CorruptShardError(shard, f"{what}: decompresses past the {limit} bytes allowed")
    return out
