"""Dispatch between the shard formats: bytes <-> `ShardArrays`, with hashing, and format v2's block index."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from shardkit.errors import CorruptShardError
from shardkit.formats.arrow_format import (decode_arrow, decode_arrow_block, encode_arrow, record_batch_ranges,
                                           samples_per_batch)
from shardkit.formats.blocks import DEFAULT_BLOCK_BYTES, Block, BlockIndex, block_cuts, block_of
from shardkit.formats.sample import ShardArrays
from shardkit.formats.tar_format import BLOCK as TAR_BLOCK
from shardkit.formats.tar_format import RECORD as TAR_RECORD
from shardkit.formats.tar_blocks import Group, decode_tar_any, decode_tar_block, encode_tar_groups
from shardkit.formats.tar_format import encode_tar, sample_member_starts, sample_raw_bytes

SHARD_EXTENSIONS = {"tar": ".tar", "arrow": ".arrow"}
SHARD_FORMAT_VERSIONS = (1, 2)
# How a tar shard's samples map to members: a member group per block (`tar_blocks`, compact) or a member
# per sample and field (`tar_format`, the earlier layout; one webdataset record per sample without a helper).
TAR_LAYOUTS = ("blocks", "samples")


def shard_layout(format_version: int, tar_layout: str | None) -> str:
    """Check a writer's shard format version and tar layout; returns the layout to write. The group layout
    ("blocks", the default) goes with block indexes; version 1, what the oldest readers read, keeps the
    per-sample layout, which those readers parse (a group layout shard under a version 1 manifest would
    look corrupt to them)."""
    if format_version not in SHARD_FORMAT_VERSIONS:
        raise ValueError(f"format_version must be one of {SHARD_FORMAT_VERSIONS}, got {format_version!r}")
    if tar_layout is None:
        return "blocks" if format_version >= 2 else "samples"
    if tar_layout not in TAR_LAYOUTS:
        raise ValueError(f"tar_layout must be one of {TAR_LAYOUTS}, got {tar_layout!r}")
    if tar_layout == "blocks" and format_version == 1:
        raise ValueError("tar_layout 'blocks' needs format_version 2 (block indexes); format_version 1 writes "
                         "tar_layout 'samples'")
    return tar_layout


def manifest_version(shard_format: str, format_version: int, tar_layout: str) -> int:
    """The manifest version (`shardkit.manifest.FORMAT_VERSIONS`) that shards written so need: 3 for group layout
    tar shards (readers of 2 do not parse them), else the shards' own version."""
    return 3 if shard_format == "tar" and tar_layout == "blocks" else format_version


_ARROW_TRAILER = 10  # int32 footer length + b"ARROW1" at the very end of an Arrow IPC file


@dataclass(frozen=True)
class EncodedShard:
    """A serialised shard and the facts the manifest records about it (the index fields: format v2 only).

    `pieces` are the file's bytes in order (the encoder's output around the block index it inserts), kept
    apart: joining them would copy a whole compressed shard once more; `data` joins them on request."""

    pieces: tuple[bytes | memoryview, ...]
    samples: int
    tokens: int
    raw_bytes: int
    sha256: str
    has_doc_boundaries: bool
    index_offset: int | None = None
    index_bytes: int | None = None
    index_sha256: str | None = None

    @property
    def data(self) -> bytes:
        return b"".join(self.pieces)

    @property
    def size(self) -> int:
        return sum(len(piece) for piece in self.pieces)


def encode_shard(arrays: ShardArrays, *, shard_format: str, token_dtype: str, level: int = 3,
                 format_version: int = 2, block_bytes: int | None = None, tar_layout: str | None = None) -> EncodedShard:
    """Serialise a shard. Version 2 (the default) adds a block index (`shardkit.formats.blocks`); an
    empty shard has no blocks, so it is written as version 1 either way. `block_bytes`: raw bytes per
    block (tar member groups and Arrow record batches alike; default `DEFAULT_BLOCK_BYTES`).
    `tar_layout`: one of `TAR_LAYOUTS` (tar shards only; default `shard_layout`'s)."""
    if block_bytes is None:
        block_bytes = DEFAULT_BLOCK_BYTES.get(shard_format, 1 << 20)
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
        raise ValueError(f"block_bytes must be a positive integer, got {block_bytes!r}")
    tar_layout = shard_layout(format_version, tar_layout)
    groups = None
    if shard_format == "tar" and tar_layout == "blocks":
        data, raw, groups = encode_tar_groups(arrays, level=level, block_bytes=block_bytes)
    elif shard_format == "tar":
        data, raw = encode_tar(arrays, level=level)
    elif shard_format == "arrow":
        data, raw = encode_arrow(arrays, token_dtype=token_dtype, level=level, batch_bytes=block_bytes)
    else:
        raise ValueError(f"shard_format must be 'tar' or 'arrow', got {shard_format!r}")
    index_fields: dict = {}
    pieces: tuple[bytes | memoryview, ...] = (data,)
    if format_version == 2 and arrays.num_samples:
        pieces, index_fields = _with_block_index(data, arrays, shard_format, block_bytes, groups)
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece)
    return EncodedShard(pieces, arrays.num_samples, int(arrays.tokens.size), raw, digest.hexdigest(),
                        arrays.has_doc_boundaries, **index_fields)


def _with_block_index(data: bytes | memoryview, arrays: ShardArrays, shard_format: str, block_bytes: int,
                      groups: list[Group] | None) -> tuple[tuple[bytes | memoryview, ...], dict]:
    """The shard bytes with the block index inserted (as the pieces of the file, in order), and the
    manifest's index fields.

    Where it goes keeps every existing reader working: after a tar's end-of-archive marker (tar
    readers stop there), in the zero padding up to tar's 10,240-byte record (one more record when it
    does not fit), and in an Arrow file between the end-of-stream marker and the footer (Arrow
    readers find the footer from the file's end and the batches through the footer's offsets, which
    stay valid because nothing before the insertion point moves). `groups`: a group layout tar's
    member groups, which are its blocks.
    """
    n = arrays.num_samples
    if groups is not None:
        cuts = [0] + [g.sample_end for g in groups]
        ranges = [(g.byte_start, g.byte_end) for g in groups]
        raws = [g.raw_bytes for g in groups]
        insert_at = groups[-1].byte_end + 2 * TAR_BLOCK
    elif shard_format == "tar":
        starts = sample_member_starts(data, n)
        per_sample = sample_raw_bytes(arrays)
        cuts = block_cuts(per_sample, block_bytes)
        ranges = [(starts[a], starts[b]) for a, b in zip(cuts[:-1], cuts[1:])]
        raws = [int(per_sample[a:b].sum()) for a, b in zip(cuts[:-1], cuts[1:])]
        insert_at = starts[-1] + 2 * TAR_BLOCK  # right after the end-of-archive blocks, in the record padding
    else:
        step = samples_per_batch(arrays, block_bytes)
        cuts = [*range(0, n, step), n]
        ranges = record_batch_ranges(data)
        raws = [_arrow_block_raw(arrays, a, b) for a, b in zip(cuts[:-1], cuts[1:])]
        insert_at = len(data) - _ARROW_TRAILER - int.from_bytes(bytes(data[-_ARROW_TRAILER:-6]), "little")
    if len(ranges) != len(cuts) - 1:
        raise ValueError(f"found {len(ranges)} blocks in the encoded shard, expected {len(cuts) - 1}")
    doc_offsets = arrays.doc_offsets if arrays.doc_offsets is not None else np.zeros(n + 1, dtype=np.int64)
    offsets = arrays.sample_offsets
    blocks = [block_of(data, byte_start=s, byte_end=e, sample_start=a, sample_end=b, token_start=int(offsets[a]),
                       token_end=int(offsets[b]), doc_start=int(doc_offsets[a]), doc_end=int(doc_offsets[b]),
                       raw_bytes=raw)
              for (s, e), a, b, raw in zip(ranges, cuts[:-1], cuts[1:], raws)]
    index = BlockIndex(tuple(blocks)).to_bytes()
    view = memoryview(data)  # slices, not copies
    if shard_format == "tar":  # the index replaces padding; the file stays a whole number of tar records
        pieces = (view[:insert_at], index, b"\0" * (-(insert_at + len(index)) % TAR_RECORD))
    else:
        pieces = (view[:insert_at], index, view[insert_at:])
    return pieces, {"index_offset": insert_at, "index_bytes": len(index),
                    "index_sha256": hashlib.sha256(index).hexdigest()}


def _arrow_block_raw(arrays: ShardArrays, lo: int, hi: int) -> int:
    """`batch_raw_bytes` of the record batch of samples [lo, hi), from the arrays."""
    rows = hi - lo
    raw = 4 * rows + int(arrays.sample_offsets[hi] - arrays.sample_offsets[lo]) * arrays.tokens.dtype.itemsize
    if arrays.doc_offsets is not None:
        raw += 3 * 4 * rows + int(arrays.doc_offsets[hi] - arrays.doc_offsets[lo]) * (4 + 4 + 8)
    return raw


def decode_shard(data: bytes | memoryview, *, shard_format: str, token_dtype: str, shard: str, raw_bytes: int) -> ShardArrays:
    """Decode shard bytes; `raw_bytes` from the manifest bounds decompression and must match exactly."""
    if shard_format == "tar":
        return decode_tar_any(data, token_dtype=token_dtype, shard=shard, raw_bytes=raw_bytes)
    if shard_format == "arrow":
        return decode_arrow(data, token_dtype=token_dtype, shard=shard, raw_bytes=raw_bytes)
    raise ValueError(f"shard_format must be 'tar' or 'arrow', got {shard_format!r}")


def decode_block(data: bytes | memoryview, block: Block, *, number: int, shard_format: str, token_dtype: str,
                 has_docs: bool, shard: str) -> ShardArrays:
    """Decode the verified bytes of one block into arrays of its samples, checking them against its entry.
    The arrays may be views of `data` (copy them before `data` changes)."""
    if shard_format == "tar":
        arrays = decode_tar_block(data, token_dtype=token_dtype, shard=shard, raw_bytes=block.raw_bytes,
                                  first_sample=block.sample_start)
    elif shard_format == "arrow":
        arrays = decode_arrow_block(data, token_dtype=token_dtype, has_docs=has_docs, shard=shard,
                                    raw_bytes=block.raw_bytes, number=number)
    else:
        raise ValueError(f"shard_format must be 'tar' or 'arrow', got {shard_format!r}")
    docs = int(arrays.doc_offsets[-1]) if arrays.doc_offsets is not None else 0
    if (arrays.num_samples != block.samples or arrays.tokens.size != block.token_end - block.token_start
            or docs != block.doc_end - block.doc_start or arrays.has_doc_boundaries != has_docs):
        raise CorruptShardError(shard, f"{block.describe(number)} holds {arrays.num_samples} samples / "
                                       f"{arrays.tokens.size} tokens / {docs} segments, its index entry says "
                                       f"{block.samples} / {block.token_end - block.token_start} / "
                                       f"{block.doc_end - block.doc_start}")
    return arrays


def check_shard_bytes(data: bytes | memoryview, *, shard: str, sha256: str, size: int) -> None:
    """Raise `CorruptShardError` unless `data` has the manifest's size and SHA-256."""
    if len(data) != size:
        raise CorruptShardError(shard, f"size is {len(data)} bytes, the manifest says {size} (truncated or replaced)")
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise CorruptShardError(shard, f"sha256 is {digest}, the manifest says {sha256}")
