"""`cache_mode` "compressed" and "none": shards decoded into memory at each open (docs/LOADING.md, the trade-off).

"compressed" keeps `<shard name>.<16 hex>.skz` per shard: the verified shard file as stored, checked against
the manifest's SHA-256 again at every open (a local file is no more trusted than a remote one) and decoded
into memory. "none" keeps nothing on disk: every open reads the verified shard from storage into memory, and
every process streams its own shards (there is no shared copy to wait for).
"""

from __future__ import annotations

import logging
import os

from shardkit import metrics
from shardkit.errors import CorruptShardError
from shardkit.formats import ShardArrays, check_shard_bytes, read_shard
from shardkit.manifest import ShardInfo
from shardkit.storage import write_file_atomic

from .block_reader import BlockReader
from .directory import COMPRESSED_SUFFIX
from .store import CachedShard, Release, StoreContext, claim_download

logger = logging.getLogger(__name__)


def _read_from_storage(context: StoreContext, shard: ShardInfo) -> bytes | memoryview:
    """The verified bytes of `shard`, read whole from storage (a cache miss)."""
    metrics.cache_lookup(context.url, hit=False)
    return read_shard(context.storage_of(), shard, on_read=context.stats.count_download)


def _nothing() -> None:
    """Releases the claim of a store that keeps nothing."""


class StreamStore:
    """"none": nothing on disk; every open reads the shard from storage (single pass).

    Args:
        context: the dataset and its counters.
    """

    on_disk = False  # keeps files in the node's cache directory (`keeps_node_files`)
    keeps_bytes = False

    def __init__(self, context: StoreContext):
        self._context = context

    def contains(self, index: int) -> bool:
        """Never: this store keeps nothing."""
        return False

    def lookup(self, index: int) -> CachedShard:
        """Shard `index` read from storage, verified and decoded into memory."""
        shard = self._context.manifest.shards[index]
        data = _read_from_storage(self._context, shard)
        return CachedShard(self._context.decode_in_memory(shard, data), self)

    def prefetch(self, index: int) -> bool:
        """Nothing to keep: the reader reads the shard when it needs it."""
        return False

    def claim(self, index: int) -> Release | None:
        """Every process completes the shards it reads block by block (the read-ahead of its own blocks)."""
        return _nothing

    def put(self, index: int, arrays: ShardArrays, data: bytes | memoryview | None) -> None:
        """Nothing is kept."""

    def abandon(self, partial: BlockReader) -> None:
        """Nothing would keep the rest of the shard: stop fetching it."""
        partial.cancel()


class CompressedStore:
    """"compressed": the verified shard files as stored, decoded into memory at each open.

    Args:
        context: the dataset, its cache directory and counters.
    """

    on_disk = True  # keeps files in the node's cache directory (`keeps_node_files`)
    keeps_bytes = True  # a shard completed block by block is assembled as its file, to be stored

    def __init__(self, context: StoreContext):
        self._context = context

    def _path(self, index: int) -> str:
        return self._context.path(index, COMPRESSED_SUFFIX)

    def contains(self, index: int) -> bool:
        """Whether the compressed cache file of shard `index` exists."""
        return os.path.exists(self._path(index))

    def lookup(self, index: int) -> CachedShard:
        """Shard `index` from its compressed cache file (checked again), else from storage (then kept)."""
        shard = self._context.manifest.shards[index]
        data = self._read_kept(shard, self._path(index))
        if data is None:
            data = _read_from_storage(self._context, shard)
            self.put(index, None, data)
        return CachedShard(self._context.decode_in_memory(shard, data), self)

    def _read_kept(self, shard: ShardInfo, path: str) -> bytes | None:
        """The bytes of the compressed cache file `path` when it passes the manifest's check, else None
        (a file that fails it is removed)."""
        try:
            with open(path, "rb") as fh:
                data = fh.read()
            check_shard_bytes(data, shard=path, sha256=shard.sha256, size=shard.compressed_bytes)
        except FileNotFoundError:
            return None
        except CorruptShardError as err:
            logger.warning("compressed cache file %s failed its check (%s): fetching the shard again", path,
                           err.reason)
            os.unlink(path)
            return None
        self._context.stats.hits += 1
        metrics.cache_lookup(self._context.url, hit=True)
        return data

    def prefetch(self, index: int) -> bool:
        """Download shard `index` whole (verified) into its compressed cache file; True when it is there."""
        if not self.contains(index):
            self.put(index, None, read_shard(self._context.storage_of(), self._context.manifest.shards[index],
                                             on_read=self._context.stats.count_download))
        return True

    def claim(self, index: int) -> Release | None:
        """This process completes shard `index` when it holds the node's download lock of it."""
        return claim_download(self._context, index)

    def put(self, index: int, arrays: ShardArrays | None, data: bytes | memoryview | None) -> None:
        """Write the verified file `data` of shard `index` (atomically: a reader finds all of it or none)."""
        if data is None:
            raise ValueError(f"shard {self._context.manifest.shards[index].name}: the compressed store keeps "
                             "a shard's file, and none was given")
        path = self._path(index)
        self._context.private_dirs(path)
        # No fsync: a cache file lost in a crash is fetched again, and one cut short fails its check at the next open.
        write_file_atomic(path, data, fsync=False)

    def abandon(self, partial: BlockReader) -> None:
        """Finish and store the shard (see `DecodedStore.abandon`)."""
        partial.start_completion()
