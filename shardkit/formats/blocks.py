"""Format version 2: the block index, which lets a reader verify and decode one block of a shard alone.

A *block* is a run of consecutive samples stored as one contiguous byte range of the shard file: one
Arrow record batch (one IPC message) of an `arrow` shard, or a group of consecutive samples' tar
members (headers, zstd frames and padding) of a `tar` shard. A block decodes without the rest of the
file: the manifest gives the schema (token dtype, document boundaries), so an Arrow record batch
message needs no schema message, and a tar member group is a tar archive without its end marker.

The index is a small binary table stored inside the shard file (`BlockIndex.to_bytes`):

    b"SKBLKIX1"                     8-byte magic
    count                           uint64
    count entries of 104 bytes      9 x uint64 + 32-byte SHA-256 digest, little-endian:
        byte_start, byte_end        the block's bytes in the shard file, [start, end)
        sample_start, sample_end    its samples, [start, end) of the shard's samples
        token_start, token_end      its tokens in the shard's token order
        doc_start, doc_end          its document segments (0, 0 without document boundaries)
        raw_bytes                   its payload size as the manifest's `raw_bytes` counts it
        sha256                      SHA-256 of bytes [byte_start, byte_end)

Why a table in the shard, with only its location and SHA-256 in the manifest (`index_offset`,
`index_bytes`, `index_sha256`), rather than every block's hash in the manifest: the manifest stays
O(1) per shard (a 64 MiB tar shard has 512 blocks: 512 hashes in JSON would be ~50 KB per shard, 50 GB for a
million shards, which every rank parses at start-up), and the index costs one small ranged read,
which is verified against the manifest like everything else. The chain of trust is manifest ->
index -> block, so no byte is used before its hash matched.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shardkit.errors import CorruptShardError

INDEX_MAGIC = b"SKBLKIX1"
_ENTRY = struct.Struct("<9Q32s")
_HEADER = struct.Struct("<8sQ")
# Raw (uncompressed) bytes per block: one block is what a reader fetches and decompresses to serve one
# sample. Arrow keeps its 1 MiB record batches (decoding one is a few vectorised buffer copies). A tar
# block is one zstd frame per field (`tar_blocks`): its frame must be large enough to compress like
# Arrow's (on GPT-2 tokens 128 KiB groups came out ~7% larger than Arrow, 256 KiB ~1%), and small,
# since the first batch of a shuffled shard touches about one block per sample.
DEFAULT_BLOCK_BYTES = {"tar": 256 << 10, "arrow": 1 << 20}


def block_cuts(raw_sizes: np.ndarray, block_bytes: int) -> list[int]:
    """Where a tar shard's blocks start, plus the sample count, from each sample's raw bytes: a block ends at the
    first sample that brings it to `block_bytes` (both tar layouts cut so)."""
    reached = np.cumsum(raw_sizes)
    cuts, n = [0], len(raw_sizes)
    while cuts[-1] < n:
        before = int(reached[cuts[-1] - 1]) if cuts[-1] else 0
        cuts.append(min(n, int(np.searchsorted(reached, before + block_bytes)) + 1))
    return cuts


@dataclass(frozen=True)
class Block:
    """One independently verifiable run of samples (see the module docstring for the fields)."""

    byte_start: int
    byte_end: int
    sample_start: int
    sample_end: int
    token_start: int
    token_end: int
    doc_start: int
    doc_end: int
    raw_bytes: int
    sha256: bytes

    @property
    def samples(self) -> int:
        return self.sample_end - self.sample_start

    def describe(self, number: int) -> str:
        return (f"block {number} (bytes {self.byte_start}-{self.byte_end}, samples "
                f"{self.sample_start}-{self.sample_end})")


def encoded_index_end(data: bytes | memoryview, position: int) -> int | None:
    """Where the block index encoded at `position` of `data` ends (its header says how many entries follow), or
    None when no whole index starts there (no magic, or cut short). Finds the indexes laid side by side in
    `shardkit.blocks`; it checks nothing else (`BlockIndex.from_bytes` does)."""
    if len(data) - position < _HEADER.size:
        return None
    magic, count = _HEADER.unpack_from(data, position)
    end = position + _HEADER.size + count * _ENTRY.size
    return end if magic == INDEX_MAGIC and end <= len(data) else None


@dataclass(frozen=True)
class BlockIndex:
    blocks: tuple[Block, ...]

    def to_bytes(self) -> bytes:
        out = bytearray(_HEADER.pack(INDEX_MAGIC, len(self.blocks)))
        for b in self.blocks:
            out += _ENTRY.pack(b.byte_start, b.byte_end, b.sample_start, b.sample_end, b.token_start, b.token_end,
                               b.doc_start, b.doc_end, b.raw_bytes, b.sha256)
        return bytes(out)

    @classmethod
    def from_bytes(cls, data: bytes, *, shard: str, samples: int, tokens: int, raw_bytes: int,
                   index_offset: int) -> BlockIndex:
        """Parse an index whose SHA-256 already matched the manifest, and check that its blocks tile the
        shard: samples, tokens and segments contiguous from 0, byte ranges in order before the index, raw
        sizes summing to the manifest's `raw_bytes`. (A matching hash proves the writer wrote it, not that
        the writer was right; these checks keep a buggy or hostile writer from steering reads.)"""
        if len(data) < _HEADER.size or data[:8] != INDEX_MAGIC:
            raise CorruptShardError(shard, "block index lacks its magic")
        _, count = _HEADER.unpack_from(data)
        if len(data) != _HEADER.size + count * _ENTRY.size:
            raise CorruptShardError(shard, f"block index of {len(data)} bytes cannot hold {count} entries")
        blocks = tuple(Block(*_ENTRY.unpack_from(data, _HEADER.size + i * _ENTRY.size)) for i in range(count))
        sample = token = doc = raw = byte = 0
        for number, b in enumerate(blocks):
            if (b.sample_start != sample or b.token_start != token or b.doc_start != doc or b.byte_start < byte
                    or b.sample_end <= b.sample_start or b.token_end < b.token_start or b.doc_end < b.doc_start
                    or b.byte_end <= b.byte_start):
                raise CorruptShardError(shard, f"block index entry {number} does not follow entry {number - 1}")
            sample, token, doc, raw, byte = b.sample_end, b.token_end, b.doc_end, raw + b.raw_bytes, b.byte_end
        if sample != samples or token != tokens or raw != raw_bytes or byte > index_offset:
            raise CorruptShardError(shard, f"block index covers {sample} samples / {token} tokens / {raw} raw bytes "
                                           f"up to byte {byte}; the manifest says {samples} / {tokens} / {raw_bytes} "
                                           f"with the index at byte {index_offset}")
        return cls(blocks)

    @property
    def doc_count(self) -> int:
        return self.blocks[-1].doc_end if self.blocks else 0

    @functools.cached_property
    def sample_ends(self) -> np.ndarray:
        return np.fromiter((b.sample_end for b in self.blocks), dtype=np.int64, count=len(self.blocks))

    def blocks_of(self, local_samples: Sequence[int] | np.ndarray) -> list[int]:
        """Numbers of the blocks holding the given sample indices, sorted, without repeats."""
        found = np.searchsorted(self.sample_ends, np.asarray(local_samples, dtype=np.int64), side="right")
        return sorted(set(found.tolist()))  # a batch touches a handful of blocks: cheaper than np.unique


def block_of(data: bytes | memoryview, *, byte_start: int, byte_end: int, sample_start: int, sample_end: int,
             token_start: int, token_end: int, doc_start: int, doc_end: int, raw_bytes: int) -> Block:
    """A `Block` entry for bytes [byte_start, byte_end) of `data` (the writer's side)."""
    digest = hashlib.sha256(memoryview(data)[byte_start:byte_end]).digest()
    return Block(byte_start, byte_end, sample_start, sample_end, token_start, token_end, doc_start, doc_end,
                 raw_bytes, digest)


def check_block_bytes(data: bytes, block: Block, *, shard: str, number: int) -> None:
    """Raise `CorruptShardError` naming the shard and block unless `data` is that block's bytes."""
    if len(data) != block.byte_end - block.byte_start:
        raise CorruptShardError(shard, f"{block.describe(number)}: read {len(data)} bytes, expected "
                                       f"{block.byte_end - block.byte_start}")
    digest = hashlib.sha256(data).digest()
    if digest != block.sha256:
        raise CorruptShardError(shard, f"{block.describe(number)}: sha256 is {digest.hex()}, the block index says "
                                       f"{block.sha256.hex()}")
