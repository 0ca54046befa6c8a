"""What the node cache keeps of each shard: the contract of a shard store, and the handle a reader holds.

`ShardCache` (`shardkit.loaders.cache.shard_cache`) resolves `cache_mode` once, in `make_store`, into one store behind
`ShardStore`: "decoded" (`shardkit.loaders.cache.decoded_store`), "compressed" or "none"
(`shardkit.loaders.cache.memory_stores`). The cache opens, holds and prefetches shards through it and never asks
which mode it runs in; each store decides where a shard comes from on a lookup, what a prefetch keeps, and
what becomes of a shard completed block by block (`shardkit.loaders.cache.block_reader`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from shardkit.formats import ShardArrays, ShardReader, check_decoded, decode_shard
from shardkit.manifest import Manifest, ShardInfo
from shardkit.node_cache import private_tree
from shardkit.storage import Storage

from .block_reader import BlockReader, BlockRequest
from ..delivery.closing import closer
from .directory import DECODED_SUFFIX, shard_file, try_exclusive_lock

Release = Callable[[], None]


@dataclass
class CacheStats:
    """What this process did to the cache (for reports and tests)."""

    downloads: int = 0
    downloaded_bytes: int = 0
    hits: int = 0
    evictions: int = 0
    range_reads: int = 0  # ranged reads of format v2 blocks and indexes (also counted in downloaded_bytes)

    def count_download(self, nbytes: int) -> None:
        """A whole shard read from storage."""
        self.downloads += 1
        self.downloaded_bytes += nbytes

    def count_range(self, nbytes: int) -> None:
        """A ranged read (a block or a block index)."""
        self.range_reads += 1
        self.downloaded_bytes += nbytes


class Handoff:
    """The shards threads of this process are fetching whole, and their arrays once decoded: a prefetch
    thread hands a shard to a reader waiting for it in memory, before its decoded file is written (one
    write less before the first batch)."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._fetching: set[str] = set()
        self._fresh: dict[str, ShardArrays] = {}

    def __contains__(self, path: str) -> bool:
        return path in self._fetching

    def begin(self, path: str) -> None:
        """A thread of this process starts fetching `path`."""
        with self._condition:
            self._fetching.add(path)

    def offer(self, path: str, arrays: ShardArrays) -> None:
        """The arrays of `path` are decoded: readers waiting for it may take them now."""
        with self._condition:
            self._fresh[path] = arrays
            self._condition.notify_all()

    def end(self, path: str) -> None:
        """The fetch of `path` ended (its file is written, or it failed)."""
        with self._condition:
            self._fetching.discard(path)
            self._fresh.pop(path, None)
            self._condition.notify_all()

    def wait(self, path: str) -> ShardArrays | None:
        """The arrays of `path` if a thread of this process is fetching it (after its decode), else None."""
        with self._condition:
            while path in self._fetching and path not in self._fresh:
                self._condition.wait()
            return self._fresh.get(path)


class StorageOpener:
    """Returns the dataset's `Storage`, opened again in a forked process.

    Filesystems such as s3fs refuse to run in a forked child (their event loop belongs to the parent): a
    DataLoader worker forked from the main process opens its own.

    Args:
        storage: the dataset's storage in this process.
    """

    def __init__(self, storage: Storage):
        self._storage = storage
        self._pid = os.getpid()

    @property
    def url(self) -> str:
        """The dataset's URL (without opening the storage again)."""
        return self._storage.url

    def __call__(self) -> Storage:
        if os.getpid() != self._pid:
            self._storage = Storage(self._storage.url, self._storage.storage_options, retry=self._storage.retry)
            self._pid = os.getpid()
        return self._storage


@dataclass(frozen=True, kw_only=True)
class StoreContext:
    """What a store works with, resolved once per process by the shard cache.

    Attributes:
        manifest: the dataset's manifest (names, sizes, hashes).
        storage_of: returns the dataset's `Storage` (the cache opens a new one after a fork).
        url: the dataset's URL (the label of the cache metrics).
        cache_root: the node cache's root (every dataset; eviction scans it).
        directory: this dataset's directory under `cache_root`.
        stats: the counters of this process.
        cache_limit: bytes of decoded shards allowed under `cache_root`, None = no limit.
        wait_timeout: seconds to wait for live readers to free room before `CacheLimitError`.
        handoff: the shards threads of this process are fetching whole.
    """

    manifest: Manifest
    storage_of: Callable[[], Storage]
    url: str
    cache_root: str
    directory: str
    stats: CacheStats
    cache_limit: int | None = None
    wait_timeout: float = 60.0
    handoff: Handoff = field(default_factory=Handoff)

    def path(self, index: int, suffix: str = DECODED_SUFFIX) -> str:
        """The cache file of shard `index` with `suffix` (never outside `directory`)."""
        return shard_file(self.directory, self.manifest.shards[index], suffix)

    def private_dirs(self, path: str) -> None:
        """Create or check (private to this user) every directory from the cache root to `path`'s."""
        private_tree(self.cache_root, os.path.dirname(path))

    def decode_in_memory(self, shard: ShardInfo, data: bytes | memoryview) -> ShardReader:
        """A reader of the verified bytes `data` of `shard`, decoded into memory and checked."""
        manifest = self.manifest
        arrays = decode_shard(data, shard_format=manifest.shard_format, token_dtype=manifest.token_dtype,
                              shard=shard.name, raw_bytes=shard.raw_bytes)
        check_decoded(arrays, shard, vocab_size=manifest.tokenizer.vocab_size)
        return ShardReader(arrays, name=shard.name)


def claim_download(context: StoreContext, index: int) -> Release | None:
    """The node's right to complete and store shard `index` (its download lock, taken without waiting):
    a function that gives it back, or None when another process of the node holds it."""
    path = context.path(index)
    context.private_dirs(path)
    download = try_exclusive_lock(path + ".dl")
    return None if download is None else download.close


class CachedShard:
    """A shard held open for reading; `close()` lets eviction remove it again.

    Args:
        reader: reads the shard's samples.
        store: the store that holds it.
        nbytes: bytes of the node cache it holds (0 when it is in memory only).
        release: lets go of the shard (its reader lock), once; None when there is nothing to release.
        partial: the shard being read block by block, when it is not all here yet.
        adopt: for a block-by-block handle on a shard another process of the node completes: returns
            the node's stored copy held for reading once there is one, else None.
    """

    def __init__(self, reader: ShardReader, store: ShardStore, *, nbytes: int = 0, release: Release | None = None,
                 partial: BlockReader | None = None, adopt: Callable[[], CachedShard | None] | None = None):
        self.reader, self.nbytes, self.partial = reader, nbytes, partial
        self._store = store
        self._release = release  # None once released
        self._adopt = adopt
        self._closed = False
        self._closer = closer  # what `__del__` needs, reachable without module globals
        self._pid = closer.pid
        closer.start()

    @property
    def complete(self) -> bool:
        """Whether every sample is readable now; otherwise `ensure` the samples before reading them."""
        return self.partial is None or self.partial.complete

    def ensure(self, local_samples) -> None:
        """Make the given samples (indices within the shard) readable: fetch and verify their blocks."""
        self.request(local_samples).wait()

    def start_index(self) -> None:
        """Start reading the block index of a shard read block by block (see `BlockReader.start_index`)."""
        if self.partial is not None and not self.partial.complete:
            self.partial.start_index()

    def request(self, local_samples) -> BlockRequest:
        """Start fetching the blocks of the given samples; `wait()` on the result makes them readable."""
        if self._whole():
            return BlockRequest()
        return self.partial.request(local_samples)

    def request_samples(self, local_samples) -> Callable[[], list[ShardArrays]]:
        """Start reading the given samples for a first batch; the function returned gives each as arrays of its
        own (`BlockReader.request_samples` while the shard arrives block by block, else slices of its arrays)."""
        if self._whole():
            arrays, local = self.reader.arrays, np.asarray(local_samples, dtype=np.int64).reshape(-1).tolist()
            return lambda: [arrays.slice(i, i + 1) for i in local]
        return self.partial.request_samples(local_samples)

    def _whole(self) -> bool:
        """Whether every sample is readable from `reader` now (after adopting the node's stored copy, when another
        process of the node stored the shard meanwhile)."""
        if self.partial is None or self.partial.complete:
            return True
        if self._adopt is not None and (stored := self._adopt()) is not None:
            # Another process of the node stored the shard: read that copy from now on.
            self.reader, self.nbytes, self._release, self.partial = stored.reader, stored.nbytes, stored._release, None
            stored._release = None  # this handle holds the stored copy now
            return True
        return False

    def close(self) -> None:
        """Let go of the shard (a shard still arriving block by block is finished or stopped, as its store says)."""
        parts = self._take_parts()
        if parts is not None:
            self._let_go(*parts)

    def __del__(self) -> None:
        # The collector runs this wherever it finds the handle unreachable, maybe in a thread that holds a
        # lock the close takes, or at interpreter exit: no lock here, the close goes to the closing thread
        # (shardkit.loaders.delivery.closing).
        parts = self._take_parts()
        if parts is not None:
            self._closer.later(self._let_go, *parts)

    def _take_parts(self) -> tuple[ShardStore, BlockReader | None, Release | None] | None:
        """What closing has left to do, once: None when nothing (closed already, or a handle a forked process
        inherited: its locks and threads belong to the process that opened it)."""
        if self._closed:
            return None
        self._closed = True
        if self._pid != self._closer.pid:
            return None
        partial = self.partial if self.partial is not None and not self.partial.complete else None
        release, self._release = self._release, None
        return (self._store, partial, release) if partial is not None or release is not None else None

    @staticmethod
    def _let_go(store: ShardStore, partial: BlockReader | None, release: Release | None) -> None:
        if partial is not None:
            store.abandon(partial)
        if release is not None:
            release()


class ShardStore(Protocol):
    """What the node cache keeps of each shard: one implementation per `cache_mode`.

    Attributes:
        on_disk: keeps files in the node's cache directory (then the node's manifest copy lives there too).
        keeps_bytes: a shard completed block by block is assembled as its file too, for `put`.
    """

    on_disk: bool
    keeps_bytes: bool

    def contains(self, index: int) -> bool:
        """Whether this store keeps shard `index` on the node now."""
        ...

    def lookup(self, index: int) -> CachedShard:
        """Hold shard `index` for reading, fetching and verifying it first when it is not kept.

        Raises:
            CorruptShardError: the shard's bytes are still wrong after a re-read.
            CacheLimitError: `cache_limit` leaves no room for it while live readers hold the rest.
        """
        ...

    def prefetch(self, index: int) -> bool:
        """Fetch shard `index` ahead of its reader when this store keeps shards; True when it is kept now."""
        ...

    def claim(self, index: int) -> Release | None:
        """Whether this process completes shard `index` when it is read block by block: a function that
        lets go of the claim once the shard is stored (or failed), or None when another process of the
        node completes it."""
        ...

    def put(self, index: int, arrays: ShardArrays, data: bytes | memoryview | None) -> None:
        """Keep shard `index`, completed block by block and verified (`data`: its file, if `keeps_bytes`)."""
        ...

    def abandon(self, partial: BlockReader) -> None:
        """A reader let go of `partial` before it was complete: finish and keep it, or stop fetching it."""
        ...
