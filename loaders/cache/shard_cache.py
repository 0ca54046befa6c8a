"""The node-local shard cache, shared by every rank and worker process of a node: opens, holds and
prefetches the shards of one dataset.

`cache_mode` says what the cache keeps (see docs/LOADING.md for the trade-off), and `make_store` resolves
it once into a store (`shardkit.loaders.cache.store.ShardStore`): "decoded" (`shardkit.loaders.cache.decoded_store`:
decompressed once per node, read through mmap), "compressed" (the verified shard files as stored, decoded
into memory at each open) or "none" (nothing on disk: every open reads from storage into memory; both in
`shardkit.loaders.cache.memory_stores`). The node's processes coordinate through `flock` locks only
(`shardkit.loaders.cache.directory`), so a crashed or SIGKILLed process can never block or poison the others.

With `open(..., on_demand=True)` (the dataset's cold path), a format v2 shard that is not local yet is
served block by block (`shardkit.loaders.cache.block_reader`): the blocks the first batches need come by ranged reads,
verified against their hashes, and the shard is completed in the background and then stored as the store
says.

The cache root and every directory below it must belong to the user and be writable by no one else:
shardkit creates them with mode 0700 and refuses any other (`UnsafeCacheDirError`). The default root has a
predictable name, so on a shared node another user could otherwise create it first and plant decoded
files that every reader of the node would serve.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from shardkit import metrics
from shardkit.forking import restart_after_fork
from shardkit.manifest import Manifest
from shardkit.node_cache import (  # noqa: F401 - UnsafeCacheDirError, fetch_manifest: re-exported for callers
    UnsafeCacheDirError,
    dataset_cache_key,
    default_cache_dir,
    fetch_manifest,
    node_block_indexes,
    private_tree,
)
from shardkit.storage import Storage

from .block_reader import BlockReader
from .directory import CacheLimitError  # noqa: F401 - re-exported: raised through open()
from ..delivery.closing import closer
from ..config import CACHE_MODES
from .decoded_store import DecodedStore
from .memory_stores import CompressedStore, StreamStore
from .store import CachedShard, CacheStats, ShardStore, StorageOpener, StoreContext

# Parallel ranged reads of the blocks one batch needs (threads wait on I/O; hashing and zstd drop the GIL).
_BLOCK_READ_THREADS = 8
# Shards up to this size are read whole even when cold: one request beats an index read, a block read
# and a completion read, and decoding 2 MiB takes about a millisecond.
WHOLE_READ_BYTES = 2 << 20


# cache_mode -> the store that keeps what the mode says: the one table that decides by the mode.
STORES = {"decoded": DecodedStore, "compressed": CompressedStore, "none": StreamStore}


def make_store(cache_mode: str, context: StoreContext) -> ShardStore:
    """The store of `cache_mode` (`STORES`).

    Raises:
        ValueError: `cache_mode` is not one of `CACHE_MODES`.
    """
    return _store_class(cache_mode)(context)


def keeps_node_files(cache_mode: str) -> bool:
    """Whether the store of `cache_mode` keeps files in the node's cache directory (then the node keeps its
    copy of the manifest there too; "none" keeps nothing on disk, and every process reads the manifest)."""
    return _store_class(cache_mode).on_disk


def _store_class(cache_mode: str) -> type:
    try:
        return STORES[cache_mode]
    except KeyError:
        raise ValueError(f"cache_mode must be one of {', '.join(CACHE_MODES)}, got {cache_mode!r}") from None


class ShardCache:
    """Downloads, verifies, decodes and holds the shards of one dataset in a node-local directory.

    Args:
        storage: where the shards live.
        manifest: the dataset's manifest (names, sizes, hashes).
        cache_dir: node-local directory shared by all processes of the node.
        cache_limit: bytes of decoded shards allowed under `cache_dir` (all datasets), None = no limit.
        wait_timeout: seconds to wait for live readers to free room before `CacheLimitError`.
        cache_mode: "decoded", "compressed" or "none" (what the cache keeps on disk; module docstring).
    """

    def __init__(self, storage: Storage, manifest: Manifest, cache_dir: str | None = None, *,
                 cache_limit: int | None = None, wait_timeout: float = 60.0, cache_mode: str = "decoded"):
        if cache_limit is not None and cache_limit <= 0:
            raise ValueError(f"cache_limit must be a positive number of bytes or None, got {cache_limit}")
        self.cache_mode = cache_mode
        self._storage_of = StorageOpener(storage)
        self.manifest = manifest
        self.cache_root = os.path.abspath(cache_dir or default_cache_dir())
        self.directory = os.path.join(self.cache_root, dataset_cache_key(storage.url))
        self.cache_limit = cache_limit
        self.wait_timeout = wait_timeout
        self.stats = CacheStats()
        self.block_indexes = None
        self._start()
        private_tree(self.cache_root, self.directory)
        # Read once, here (a DataLoader worker inherits or unpickles them): the node's copy of the dataset's
        # block indexes, fetched with the manifest, spares each cold shard's first read a round trip.
        if keeps_node_files(cache_mode):
            self.block_indexes = node_block_indexes(storage, self.directory)
        metrics.watch_cache_dir(self.cache_root)

    def _start(self) -> None:
        """This process's store and block-by-block state (made again in a process that unpickles the cache,
        and in one forked from this one: `_after_fork`)."""
        self._context = StoreContext(manifest=self.manifest, storage_of=self._storage_of, url=self._storage_of.url,
                                     cache_root=self.cache_root, directory=self.directory, stats=self.stats,
                                     cache_limit=self.cache_limit, wait_timeout=self.wait_timeout)
        self.store = make_store(self.cache_mode, self._context)
        self._lock = threading.Lock()
        self._partial: dict[str, BlockReader] = {}  # shards this process is reading block by block
        self._block_executor: ThreadPoolExecutor | None = None
        restart_after_fork(self)

    @property
    def storage(self) -> Storage:
        """The dataset's storage (opened again in a forked process: `StorageOpener`)."""
        return self._storage_of()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["stats"] = CacheStats()
        for name in ("_context", "store", "_lock", "_partial", "_block_executor"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._start()

    def _after_fork(self) -> None:
        """In a forked child (a DataLoader worker): a store, lock and block readers of its own, as a spawned
        worker gets by unpickling; the parent's threads (block reads, completions) do not exist here."""
        self._start()

    def path(self, index: int) -> str:
        """Decoded file of shard `index` (never outside the cache directory)."""
        return self._context.path(index)

    def is_cached(self, index: int) -> bool:
        """Whether the store keeps shard `index` on the node now (never, with cache_mode "none")."""
        return self.store.contains(index)

    def needs_prefetch(self, index: int) -> bool:
        """Whether a prefetch of shard `index` would fetch anything now: the store keeps shards on the node and
        not this one yet, and this process is not completing it block by block already (a prefetch of it
        would start a thread only to return)."""
        return self.store.on_disk and self.path(index) not in self._partial and not self.store.contains(index)

    def open(self, index: int, *, on_demand: bool = False) -> CachedShard:
        """Hold shard `index` for reading, downloading it first if no process of the node has.

        With `on_demand`, a format v2 shard that is not local is returned at once, to be read block by
        block: call `ensure(samples)` on the handle before reading those samples (until `complete`).
        """
        path = self.path(index)
        if on_demand and self._serves_blocks(index, path):
            return self._open_partial(index, path)
        return self.store.lookup(index)

    def prefetch(self, index: int) -> bool:
        """Fetch shard `index` unless another process is already fetching it; True when cached."""
        if self.path(index) in self._partial:
            return False  # this process is completing it block by block already
        return self.store.prefetch(index)

    def drain(self, timeout: float | None = None) -> None:
        """Wait for the background completions of this process (e.g. before deleting the cache directory),
        including those that the closes of dropped handles, still queued for the closing thread, start."""
        closer.flush(timeout)
        for partial in list(self._partial.values()):
            partial.wait_complete(timeout)

    # -- block by block (format v2) ------------------------------------------------------------
    def _serves_blocks(self, index: int, path: str) -> bool:
        """Whether opening shard `index` now would read blocks: a v2 shard above `WHOLE_READ_BYTES`, not
        kept by the store, not being fetched whole by a thread of this process (waiting for that one is
        quicker)."""
        shard = self.manifest.shards[index]
        if not shard.has_block_index or not shard.samples or shard.compressed_bytes <= WHOLE_READ_BYTES:
            return False
        if path in self._partial or path in self._context.handoff:
            return False
        return not self.store.contains(index)

    def _blocks_executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._block_executor is None:
                self._block_executor = ThreadPoolExecutor(_BLOCK_READ_THREADS, thread_name_prefix="shardkit-blocks")
            return self._block_executor

    def _open_partial(self, index: int, path: str) -> CachedShard:
        """A handle on a shard read block by block. One process of the node (the one the store's `claim`
        names: in "decoded" and "compressed" the holder of the shard's download lock, taken without
        waiting) completes it in the background and `put`s it in the store; the others read the blocks
        they need on demand until the stored copy appears, then adopt it (`_stored_copy`): the node
        downloads the shard once, plus the blocks needed before it is stored."""
        shard = self.manifest.shards[index]
        release_claim = self.store.claim(index)
        released = threading.Event()

        def release() -> None:  # once, whether completion succeeds or fails
            if not released.is_set():
                released.set()
                self._partial.pop(path, None)
                if release_claim is not None:
                    release_claim()  # e.g. the download lock, once the copy is in place

        def on_complete(arrays, data: bytes | memoryview | None) -> None:
            self.stats.downloads += 1
            try:
                self.store.put(index, arrays, data)
            finally:
                release()

        completes = release_claim is not None
        metrics.cache_lookup(self._context.url, hit=False)
        partial = BlockReader(self._storage_of, shard, self.manifest, executor=self._blocks_executor(),
                              on_read=self.stats.count_range, on_complete=on_complete if completes else None,
                              keep_bytes=self.store.keeps_bytes,
                              held_index=self.block_indexes.get(shard) if self.block_indexes is not None else None)
        if completes:
            self._partial[path] = partial
            partial.complete_in_background(on_failure=release)
        adopt = None if completes else functools.partial(self._stored_copy, index)
        return CachedShard(partial.reader, self.store, partial=partial, adopt=adopt)

    def _stored_copy(self, index: int) -> CachedShard | None:
        """Shard `index` held from the store once another process of the node stored it, else None."""
        if not self.store.contains(index):
            return None
        try:
            return self.store.lookup(index)
        except FileNotFoundError:
            return None  # evicted in between: keep reading blocks
