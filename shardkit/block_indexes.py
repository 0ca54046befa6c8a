"""`shardkit.blocks`: every shard's block index in one small file beside the manifest, fetched with it.

A cold shard read block by block costs two round trips in a row before its first sample: its block index
(a ranged read inside the shard), then the blocks the index locates. When the dataset's block indexes are small
together (at most `MAX_BLOCK_INDEXES_BYTES`), the build also writes them side by side in `shardkit.blocks`,
which the node cache downloads in the manifest's round trip: a first batch then reads its blocks at once.

Layout (docs/FORMAT.md section 6b): the magic `SKBLKFL1`, then block indexes as the shards hold them
(`shardkit.formats.blocks`, each self-delimiting: its own magic and entry count), in any order.

Nothing in the file is trusted: an index is found by its SHA-256, the one the manifest records for the shard
(`index_sha256`), so what a reader takes from the file is byte for byte the index it would have read from
the shard, and then goes through the same checks (`BlockIndex.from_bytes`: blocks that tile the shard, and
each block's own SHA-256 when it is read). A file that is stale (the manifest was rewritten after it), cut or
edited loses only the indexes that no longer match: those shards' indexes are read from the shards, as
without the file.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from shardkit.shard_info import ShardInfo
from shardkit.storage import Storage

logger = logging.getLogger(__name__)

BLOCK_INDEXES_NAME = "shardkit.blocks"
FILE_MAGIC = b"SKBLKFL1"
# Above this the file is not written (and not read): it comes in the manifest's round trip, so its bytes are
# on the first batch's path; 1 MiB is ~10 ms at one S3 connection's ~100 MB/s, under the 20-50 ms of the
# round trip it saves. (About 2,000 indexes of tar shards of 4 MiB, 12 of 64 MiB.)
MAX_BLOCK_INDEXES_BYTES = 1 << 20
_READ_THREADS = 8  # ranged reads of the shards' indexes when the build did not keep them


class BlockIndexes:
    """The block indexes of a `shardkit.blocks` file, by SHA-256: each one is the bytes whose digest it is."""

    def __init__(self, by_digest: dict[str, bytes] | None = None):
        self._by_digest = dict(by_digest or {})

    def __len__(self) -> int:
        return len(self._by_digest)

    def get(self, shard: ShardInfo) -> bytes | None:
        """The block index of `shard` (its bytes hash to the manifest's `index_sha256`), or None when the file
        holds no such index."""
        if shard.index_sha256 is None:
            return None
        return self._by_digest.get(shard.index_sha256)

    @classmethod
    def from_bytes(cls, data: bytes, *, source: str) -> BlockIndexes:
        """The indexes of a `shardkit.blocks` file. A file that does not parse (wrong magic, an entry cut
        short) keeps the indexes before the fault, with a warning naming `source`: a damaged file costs
        round trips, never a wrong sample."""
        if data[:len(FILE_MAGIC)] != FILE_MAGIC:
            logger.warning("%s lacks its magic: not a block index file; reading each shard's own index", source)
            return cls()
        # Imported here: the formats package imports the manifest module, which imports this one.
        from shardkit.formats.blocks import encoded_index_end

        by_digest: dict[str, bytes] = {}
        position = len(FILE_MAGIC)
        while position < len(data):
            end = encoded_index_end(data, position)
            if end is None:
                break
            index = bytes(data[position:end])
            by_digest[hashlib.sha256(index).hexdigest()] = index
            position = end
        else:
            return cls(by_digest)
        logger.warning("%s is damaged at byte %d (kept the %d block indexes before it); reading the other shards' "
                       "own indexes", source, position, len(by_digest))
        return cls(by_digest)


def encode_block_indexes(indexes: Iterable[bytes]) -> bytes:
    """The `shardkit.blocks` file holding `indexes` (block indexes as the shards hold them)."""
    return FILE_MAGIC + b"".join(indexes)


def load_block_indexes(path: str, *, source: str) -> BlockIndexes | None:
    """The indexes of the local file `path` (the node cache's copy), or None when there is none or it is larger
    than `MAX_BLOCK_INDEXES_BYTES` (not one the build writes: ignored, with a warning naming `source`)."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size > MAX_BLOCK_INDEXES_BYTES + len(FILE_MAGIC):
                logger.warning("%s holds %d bytes, more than a build writes (%d): ignored", source, size,
                               MAX_BLOCK_INDEXES_BYTES)
                return None
            data = fh.read()
    except FileNotFoundError:
        return None
    return BlockIndexes.from_bytes(data, source=source)


def write_block_indexes(storage: Storage, shards: Iterable[ShardInfo]) -> bool:
    """Write `shardkit.blocks` for a manifest's `shards` when their indexes fit in `MAX_BLOCK_INDEXES_BYTES`,
    else delete an earlier one. Each index is read back from its shard (ranged reads, in parallel for a remote
    store) and checked against its `index_sha256`, so the file holds nothing the manifest does not vouch for.
    A shard that cannot be read, or whose index differs, leaves the dataset without the file (with a warning):
    the file saves a round trip, the dataset reads the same without it. Returns whether it wrote.
    """
    indexed, total = [], 0
    for shard in shards:  # stops at the bound: a manifest of a million shards is not walked
        if shard.has_block_index:
            total += shard.index_bytes
            if total > MAX_BLOCK_INDEXES_BYTES:
                indexed = []
                break
            indexed.append(shard)
    if not indexed:
        _remove(storage)
        return False

    def read(shard: ShardInfo) -> bytes:
        data = storage.read_range(shard.name, shard.index_offset, shard.index_offset + shard.index_bytes)
        if hashlib.sha256(data).hexdigest() != shard.index_sha256:
            raise ValueError(f"{storage.url_of(shard.name)}: its block index (bytes {shard.index_offset}-"
                             f"{shard.index_offset + shard.index_bytes}) does not match the manifest's index_sha256")
        return data

    try:
        if storage.is_local:
            indexes = [read(s) for s in indexed]
        else:
            with ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="shardkit-block-indexes") as pool:
                indexes = list(pool.map(read, indexed))
    except (OSError, ValueError) as err:
        logger.warning("not writing %s: %s", storage.url_of(BLOCK_INDEXES_NAME), err)
        _remove(storage)
        return False
    storage.write_bytes(BLOCK_INDEXES_NAME, encode_block_indexes(indexes))
    return True


def _remove(storage: Storage) -> None:
    """Delete an earlier `shardkit.blocks` (made for other shards: it would only be read and ignored)."""
    if storage.exists(BLOCK_INDEXES_NAME):
        storage.delete(BLOCK_INDEXES_NAME)
