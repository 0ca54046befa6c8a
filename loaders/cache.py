"""The node-local shard cache, shared by every rank and worker process of a node.

Layout: `<cache_dir>/<16 hex of the dataset URL's SHA-256>/<shard name>.<16 hex of its SHA-256>.skd`
holds a shard decompressed once (`write_decoded`) and read through mmap (`ShardReader.open_decoded`).
Naming the file after the shard's hash means a rebuilt dataset never reads stale data.

Coordination uses only `flock` locks on small companion files, which the kernel releases when a
process dies, so a crashed or SIGKILLed process can never block or poison the others:

- `<file>.dl`: exclusive while one process downloads, verifies and decodes the shard. The others
  wait on it (or, when prefetching, skip to another shard, which spreads the downloads over the
  node's processes) and then find the finished file. Decoded files appear by atomic rename only,
  and a downloader removes the temporary files a dead predecessor left behind.
- `<file>.lock`: shared while a reader holds the shard open. Eviction takes it exclusive without
  waiting, so it only ever removes shards that no live reader holds.
- `<cache root>/.room.lock` (with `cache_limit` only): exclusive while one process evicts to make room
  and writes a decoded shard, so the decoded files never exceed the limit even for a moment.

`cache_mode` says what the cache keeps (see docs/LOADING.md for the trade-off): "decoded" (the above),
"compressed" (`<shard name>.<16 hex>.skz`: the verified shard file as stored, decoded into memory at each
open) or "none" (nothing on disk: every open reads from storage into memory). With `open(...,
on_demand=True)` (the dataset's cold path), a format v2 shard that is not local yet is served block by
block (`loaders/partial.py`): the blocks the first batches need come by ranged reads, verified against
their hashes, and the shard is completed in the background and then stored as the mode says.

Downloads go through the core's one verified read (`shardkit.formats.fetch.read_shard`): bytes are
checked against the manifest's size and SHA-256 while they decode, a mismatch gets one re-read, then
`CorruptShardError` naming the shard's URL. Each decoded file records the SHA-256 of the shard it came
from and a CRC-32 of its bytes (`shardkit.formats.decoded`); a file that fails either check on open
(stale, truncated, damaged) is removed with a warning naming it and decoded again, never served.

The cache root and every directory below it must belong to the user and be writable by no one else:
shardkit creates them with mode 0700 and refuses any other (`UnsafeCacheDirError`). The default root has a
predictable name, so on a shared node another user could otherwise create it first and plant decoded
files that every reader of the node would serve. With `cache_limit`, least recently used
unheld shards are evicted to make room; when the shards held by live readers leave no room, the
cache waits up to `wait_timeout` seconds for readers to move on, then raises `CacheLimitError`.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from shardkit import metrics
from shardkit.errors import CorruptShardError
from shardkit.formats import (
    ShardReader,
    check_decoded,
    check_shard_bytes,
    decode_shard,
    open_decoded,
    read_shard,
    write_decoded,
)
from shardkit.loaders.config import CACHE_MODES
from shardkit.loaders.partial import BlockRequest, PartialShard
from shardkit.manifest import Manifest, ShardInfo
from shardkit.names import check_relative_name
from shardkit.node_cache import (  # noqa: F401 - UnsafeCacheDirError, fetch_manifest: re-exported for callers
    UnsafeCacheDirError,
    dataset_cache_key,
    default_cache_dir,
    fetch_manifest,
    private_directory,
    private_tree,
)
from shardkit.storage import Storage

logger = logging.getLogger(__name__)

DECODED_SUFFIX = ".skd"
COMPRESSED_SUFFIX = ".skz"
# Parallel ranged reads of the blocks one batch needs (threads wait on I/O; hashing and zstd drop the GIL).
_BLOCK_READ_THREADS = 8
# Shards up to this size are read whole even when cold: one request beats an index read, a block read
# and a completion read, and decoding 2 MiB takes about a millisecond.
WHOLE_READ_BYTES = 2 << 20
ROOM_LOCK = ".room.lock"  # in the cache root: held while one process makes room and admits a shard
# Decoded files hold a header (well under 1 KiB) and 64-byte-aligned arrays.
_HEADER_BOUND = 1024


class CacheLimitError(OSError):
    """`cache_limit` is too small for the shards that live readers need at the same time."""


@dataclass
class CacheStats:
    """What this process did to the cache (for reports and tests)."""

    downloads: int = 0
    downloaded_bytes: int = 0
    hits: int = 0
    evictions: int = 0
    range_reads: int = 0  # ranged reads of format v2 blocks and indexes (also counted in downloaded_bytes)


class CachedShard:
    """A shard held open for reading; `close()` lets eviction remove it again."""

    def __init__(self, reader: ShardReader, lock_fd: int | None, nbytes: int, cache: ShardCache,
                 partial: PartialShard | None = None):
        self.reader = reader
        self.nbytes = nbytes
        self._fd: int | None = lock_fd
        self._cache = cache
        self.partial = partial
        self.adoptable = False  # a block-by-block handle on a shard another process of the node completes
        self.index = -1

    @property
    def complete(self) -> bool:
        """Whether every sample is readable now; otherwise `ensure` the samples before reading them."""
        return self.partial is None or self.partial.complete

    def ensure(self, local_samples) -> None:
        """Make the given samples (indices within the shard) readable: fetch and verify their blocks."""
        self.request(local_samples).wait()

    def start_index(self) -> None:
        """Start reading the block index of a shard read block by block (see `PartialShard.start_index`)."""
        if self.partial is not None and not self.partial.complete:
            self.partial.start_index()

    def request(self, local_samples) -> BlockRequest:
        """Start fetching the blocks of the given samples; `wait()` on the result makes them readable."""
        if self.partial is None or self.partial.complete:
            return BlockRequest()
        if self.adoptable and self._cache._adopt_stored(self):
            return BlockRequest()  # another process of the node stored the shard: read that copy from now on
        return self.partial.request(local_samples)

    def close(self) -> None:
        if self.partial is not None and not self.partial.complete:
            if self._cache.cache_mode == "none":
                self.partial.cancel()  # nothing would keep the rest: stop fetching it
            else:
                # A reader that stops early (an abandoned iterator, a first-batch check) may hold the node's
                # download lock of the shard: finish and store it, or the node's readers would read it
                # block by block in every epoch and no process of the node would ever store it.
                self.partial.start_completion()
        if self._fd is not None:
            os.close(self._fd)  # releases the shared lock
            self._fd = None
            self._cache._release(self.nbytes)

    def __del__(self) -> None:
        self.close()


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
        if cache_mode not in CACHE_MODES:
            raise ValueError(f"cache_mode must be one of {', '.join(CACHE_MODES)}, got {cache_mode!r}")
        self.cache_mode = cache_mode
        self._storage = storage
        self._pid = os.getpid()
        self.manifest = manifest
        self.cache_root = os.path.abspath(cache_dir or default_cache_dir())
        self.directory = os.path.join(self.cache_root, dataset_cache_key(storage.url))
        self.cache_limit = cache_limit
        self.wait_timeout = wait_timeout
        self.stats = CacheStats()
        self._private_dirs(self.directory)
        self._held_bytes = 0
        self._lock = threading.Lock()
        self._init_handoff()
        metrics.watch_cache_dir(self.cache_root)

    def _init_handoff(self) -> None:
        # A shard a prefetch thread of this process has just decoded is handed to a waiting reader
        # in memory, before its decoded file is written (one write less before the first batch).
        self._handoff = threading.Condition()
        self._fetching: set[str] = set()
        self._fresh: dict[str, object] = {}
        self._partial: dict[str, PartialShard] = {}  # shards this process is reading block by block
        self._block_executor: ThreadPoolExecutor | None = None

    @property
    def storage(self) -> Storage:
        # Filesystems such as s3fs refuse to run in a forked child (their event loop belongs to the
        # parent): a DataLoader worker forked from the main process opens its own.
        if os.getpid() != self._pid:
            self._storage = Storage(self._storage.url, self._storage.storage_options, retry=self._storage.retry)
            self._pid = os.getpid()
        return self._storage

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["stats"], state["_held_bytes"], state["_lock"] = CacheStats(), 0, None
        for name in ("_handoff", "_fetching", "_fresh", "_partial", "_block_executor"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._init_handoff()

    # -- paths ---------------------------------------------------------------------------------
    def _private_dirs(self, directory: str) -> None:
        private_tree(self.cache_root, directory)

    def path(self, index: int) -> str:
        """Decoded file of shard `index` (never outside the cache directory)."""
        shard = self.manifest.shards[index]
        relative = check_relative_name(f"{shard.name}.{shard.sha256[:16]}{DECODED_SUFFIX}", what="shard name")
        full = os.path.normpath(os.path.join(self.directory, relative))
        if not full.startswith(self.directory + os.sep):
            raise ValueError(f"shard name {shard.name!r} would leave the cache directory {self.directory}")
        return full

    def is_cached(self, index: int) -> bool:
        if self.cache_mode == "none":
            return False
        return os.path.exists(self.path(index) if self.cache_mode == "decoded" else self.compressed_path(index))

    def compressed_path(self, index: int) -> str:
        """Compressed cache file of shard `index` ("compressed" mode): the decoded file's name, `.skz`."""
        return self.path(index)[:-len(DECODED_SUFFIX)] + COMPRESSED_SUFFIX

    @staticmethod
    def decoded_size(arrays) -> int:
        """Size of the decoded file of `arrays` (an upper bound, exact to the header padding)."""
        parts = (arrays.tokens, arrays.sample_offsets, arrays.doc_offsets, arrays.doc_starts, arrays.doc_source,
                 arrays.doc_index)
        return _HEADER_BOUND + sum(-(-a.nbytes // 64) * 64 for a in parts if a is not None)

    # -- reading -------------------------------------------------------------------------------
    def open(self, index: int, *, on_demand: bool = False) -> CachedShard:
        """Hold shard `index` for reading, downloading it first if no process of the node has.

        With `on_demand`, a format v2 shard that is not local is returned at once, to be read block by
        block: call `ensure(samples)` on the handle before reading those samples (until `complete`).
        """
        shard = self.manifest.shards[index]
        path = self.path(index)
        if on_demand and self._serves_blocks(index, path):
            return self._open_partial(index, path)
        if self.cache_mode != "decoded":
            return self._open_in_memory(index)
        self._private_dirs(os.path.dirname(path))
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            fresh = None
            if os.path.exists(path):
                self.stats.hits += 1
                metrics.cache_lookup(self._storage.url, hit=True)
            else:
                metrics.cache_lookup(self._storage.url, hit=False)
                fresh = self._wait_for_fresh(path)
                if fresh is None:
                    self._fetch(shard, path, block=True)
            if fresh is not None:
                reader, nbytes = ShardReader(fresh, name=shard.name), self.decoded_size(fresh)
            else:
                # The lock file's mtime is the last use (eviction is least recently used); the decoded
                # file's own mtime stays its write time, part of the identity its CRC check is kept under.
                os.utime(fd)
                reader = self._open_bound(shard, path)
                nbytes = os.path.getsize(path)
        except BaseException:
            os.close(fd)
            raise
        with self._lock:
            self._held_bytes += nbytes
        metrics.inc("shardkit_cache_held_bytes", nbytes)
        return CachedShard(reader, fd, nbytes, self)

    def _open_bound(self, shard: ShardInfo, path: str) -> ShardReader:
        """Map the decoded file of `shard`; one not bound to it (stale, truncated, damaged) is decoded again."""
        try:
            found = os.stat(path)
            return ShardReader(open_decoded(path, shard=shard.name, shard_sha256=shard.sha256), name=shard.name)
        except CorruptShardError as err:
            logger.warning("discarding decoded cache file %s: %s; decoding shard %s again from its verified "
                           "bytes", path, err.reason, shard.name)
        # Under the download lock no process is writing this file: remove it unless another process
        # already replaced the bad file (a rename gives a new inode).
        with self._download_lock(path), contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == found.st_ino:
                os.unlink(path)
        self._fetch(shard, path, block=True)
        return ShardReader(open_decoded(path, shard=shard.name, shard_sha256=shard.sha256), name=shard.name)

    @contextlib.contextmanager
    def _download_lock(self, path: str):
        fd = os.open(path + ".dl", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _wait_for_fresh(self, path: str):
        """Arrays of `path` if a thread of this process is fetching it (waits for its decode)."""
        with self._handoff:
            while path in self._fetching and path not in self._fresh:
                self._handoff.wait()
            return self._fresh.get(path)

    def _release(self, nbytes: int) -> None:
        if self._lock is not None:
            with self._lock:
                self._held_bytes -= nbytes
            metrics.inc("shardkit_cache_held_bytes", -nbytes)

    def prefetch(self, index: int) -> bool:
        """Fetch shard `index` unless another process is already fetching it; True when cached."""
        path = self.path(index)
        if self.cache_mode == "none" or path in self._partial:
            return False  # nothing to keep, or this process is completing it block by block already
        if self.cache_mode == "compressed":
            return self._fetch_compressed(index)
        if os.path.exists(path):
            return True
        self._private_dirs(os.path.dirname(path))
        try:
            return self._fetch(self.manifest.shards[index], path, block=False)
        except CacheLimitError:
            return False  # no room now: the reader will fetch it when it needs it

    # -- block by block (format v2) and the modes without a decoded copy --------------------------
    def _serves_blocks(self, index: int, path: str) -> bool:
        """Whether opening shard `index` now would read blocks: a v2 shard above `WHOLE_READ_BYTES`, not
        in this mode's cache file, not being fetched whole by a thread of this process (waiting for that
        one is quicker)."""
        shard = self.manifest.shards[index]
        if not shard.has_block_index or not shard.samples or shard.compressed_bytes <= WHOLE_READ_BYTES:
            return False
        if path in self._partial or path in self._fetching:
            return False
        return not self.is_cached(index)

    def drain(self, timeout: float | None = None) -> None:
        """Wait for the background completions of this process (e.g. before deleting the cache directory)."""
        for partial in list(self._partial.values()):
            partial.wait_complete(timeout)

    def _blocks_executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._block_executor is None:
                self._block_executor = ThreadPoolExecutor(_BLOCK_READ_THREADS, thread_name_prefix="shardkit-blocks")
            return self._block_executor

    def _count_range(self, nbytes: int) -> None:
        self.stats.range_reads += 1
        self.stats.downloaded_bytes += nbytes

    def _open_partial(self, index: int, path: str) -> CachedShard:
        """A handle on a shard read block by block. One process of the node (the holder of the shard's
        download lock, taken without waiting) completes it in the background and stores it as the mode
        says; the others read the blocks they need on demand until the stored copy appears, then adopt it
        (`_adopt_stored`): the node downloads the shard once, plus the blocks needed before it is stored.
        In "none" mode every process streams its own shards (there is no shared copy to wait for)."""
        shard = self.manifest.shards[index]
        lock_fd = None
        if self.cache_mode != "none":
            self._private_dirs(os.path.dirname(path))
            lock_fd = os.open(path + ".dl", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(lock_fd)
                lock_fd = None
        completes = self.cache_mode == "none" or lock_fd is not None
        store = {"decoded": self._store_decoded, "compressed": self._store_compressed, "none": None}[self.cache_mode]
        released = threading.Event()

        def release() -> None:  # once, whether completion succeeds or fails
            if not released.is_set():
                released.set()
                self._partial.pop(path, None)
                if lock_fd is not None:
                    os.close(lock_fd)  # releases the download lock once the copy is in place

        def on_complete(arrays, data: bytes | memoryview | None) -> None:
            self.stats.downloads += 1
            try:
                if store is not None:
                    store(index, arrays, data)
            finally:
                release()

        metrics.cache_lookup(self._storage.url, hit=False)
        partial = PartialShard(lambda: self.storage, shard, self.manifest, executor=self._blocks_executor(),
                               on_read=self._count_range, on_complete=on_complete if completes else None,
                               keep_bytes=self.cache_mode == "compressed")
        if completes:
            self._partial[path] = partial
            partial.complete_in_background(on_failure=release)
        handle = CachedShard(partial.reader, None, 0, self, partial=partial)
        handle.index, handle.adoptable = index, not completes
        return handle

    def _adopt_stored(self, handle: CachedShard) -> bool:
        """Switch a block-by-block handle to the node's stored copy once one exists; True when switched."""
        index = handle.index
        if not self.is_cached(index):
            return False
        try:
            stored = self.open(index)
        except FileNotFoundError:
            return False  # evicted in between: keep reading blocks
        handle.reader, handle.nbytes, handle._fd, handle.partial = stored.reader, stored.nbytes, stored._fd, None
        stored._fd = None  # the handle owns the shared lock now
        return True

    def _store_decoded(self, index: int, arrays, data: None) -> None:
        """Write the decoded file of a shard completed block by block (the caller holds the download lock)."""
        path = self.path(index)
        try:
            if not os.path.exists(path):
                self._remove_stale_temporaries(path)
                self._admit(path, arrays, shard=self.manifest.shards[index], wait=False)
        except CacheLimitError as err:
            logger.debug("shard %s not stored in the cache: %s", self.manifest.shards[index].name, err)

    def _store_compressed(self, index: int, arrays, data: bytes | memoryview) -> None:
        path = self.compressed_path(index)
        self._private_dirs(os.path.dirname(path))
        directory = os.path.dirname(path)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=f".{os.path.basename(path)}.tmp-", delete=False) as fh:
            try:
                fh.write(data)
            except BaseException:
                os.unlink(fh.name)
                raise
        os.replace(fh.name, path)  # atomic: a reader finds the whole verified file or none

    def _fetch_compressed(self, index: int) -> bool:
        """Download shard `index` whole (verified) into the compressed cache file; True when it is there."""
        path = self.compressed_path(index)
        if not os.path.exists(path):
            data = read_shard(self.storage, self.manifest.shards[index], on_read=self._count_whole)
            self._store_compressed(index, None, data)
        return True

    def _count_whole(self, nbytes: int) -> None:
        self.stats.downloads += 1
        self.stats.downloaded_bytes += nbytes

    def _open_in_memory(self, index: int) -> CachedShard:
        """"compressed" and "none" modes: the verified shard bytes (from the compressed cache file, or from
        storage) decoded into memory. A compressed cache file is checked against the manifest's SHA-256 at
        every open, like bytes from storage: a local file is no more trusted than a remote one."""
        shard = self.manifest.shards[index]
        data = None
        if self.cache_mode == "compressed":
            path = self.compressed_path(index)
            try:
                with open(path, "rb") as fh:
                    data = fh.read()
                check_shard_bytes(data, shard=path, sha256=shard.sha256, size=shard.compressed_bytes)
                self.stats.hits += 1
                metrics.cache_lookup(self._storage.url, hit=True)
            except FileNotFoundError:
                data = None
            except CorruptShardError as err:
                logger.warning("compressed cache file %s failed its check (%s): fetching the shard again", path,
                               err.reason)
                os.unlink(path)
                data = None
        if data is None:
            metrics.cache_lookup(self._storage.url, hit=False)
            data = read_shard(self.storage, shard, on_read=self._count_whole)
            if self.cache_mode == "compressed":
                self._store_compressed(index, None, data)
        arrays = decode_shard(data, shard_format=self.manifest.shard_format, token_dtype=self.manifest.token_dtype,
                              shard=shard.name, raw_bytes=shard.raw_bytes)
        check_decoded(arrays, shard, vocab_size=self.manifest.tokenizer.vocab_size)
        return CachedShard(ShardReader(arrays, name=shard.name), None, 0, self)

    # -- downloading ---------------------------------------------------------------------------
    def _fetch(self, shard: ShardInfo, path: str, *, block: bool) -> bool:
        fd = os.open(path + ".dl", os.O_RDWR | os.O_CREAT, 0o644)
        with self._handoff:
            self._fetching.add(path)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
            except BlockingIOError:
                return False
            if os.path.exists(path):
                return True  # another process finished it while we waited
            self._remove_stale_temporaries(path)
            arrays = self._download(shard)
            return self._admit(path, arrays, shard=shard, wait=block)
        finally:
            with self._handoff:
                self._fetching.discard(path)
                self._fresh.pop(path, None)
                self._handoff.notify_all()
            os.close(fd)

    @staticmethod
    def _remove_stale_temporaries(path: str) -> None:
        # Only the holder of the download lock writes temporaries for this shard, so any that
        # exist were left by a process that died mid-write.
        directory, prefix = os.path.dirname(path), f".{os.path.basename(path)}.tmp-"
        for name in os.listdir(directory):
            if name.startswith(prefix):
                try:
                    os.unlink(os.path.join(directory, name))
                except FileNotFoundError:
                    pass

    def _download(self, shard: ShardInfo):
        download_started = time.perf_counter()

        def decode(data: bytes):
            started = time.perf_counter()
            arrays = decode_shard(data, shard_format=self.manifest.shard_format, token_dtype=self.manifest.token_dtype,
                                  shard=shard.name, raw_bytes=shard.raw_bytes)
            metrics.shard_decoded(self._storage.url, self.manifest.shard_format, time.perf_counter() - started)
            return arrays

        def count(nbytes: int) -> None:
            nonlocal download_started
            self.stats.downloads += 1
            self.stats.downloaded_bytes += nbytes
            metrics.shard_downloaded(self._storage.url, self.manifest.shard_format, nbytes,
                                     time.perf_counter() - download_started)
            download_started = time.perf_counter()

        arrays = read_shard(self.storage, shard, decode=decode, on_read=count)
        check_decoded(arrays, shard, vocab_size=self.manifest.tokenizer.vocab_size)
        return arrays

    # -- eviction ------------------------------------------------------------------------------
    def _scan(self) -> list[tuple[float, int, str]]:
        entries = []
        for directory, _, names in os.walk(self.cache_root):
            for name in names:
                if name.endswith(DECODED_SUFFIX) and not name.startswith("."):
                    full = os.path.join(directory, name)
                    try:
                        st = os.stat(full)
                    except FileNotFoundError:
                        continue
                    try:  # last use: the lock file's mtime, touched at each open
                        used = max(st.st_mtime, os.stat(full + ".lock").st_mtime)
                    except FileNotFoundError:
                        used = st.st_mtime
                    entries.append((used, st.st_size, full))
        return entries

    def _try_evict(self, path: str) -> bool:
        try:
            fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False  # a live reader holds it
        try:
            os.unlink(path)
            self.stats.evictions += 1
            metrics.inc("shardkit_cache_evictions_total")
            return True
        except FileNotFoundError:
            return False
        finally:
            os.close(fd)

    def _admit(self, path: str, arrays, *, shard: ShardInfo, wait: bool) -> bool:
        """Write the decoded shard once the limit has room for it; False when not `wait` and no room.

        Making room and writing happen under one node-wide lock (`ROOM_LOCK` in the cache root), so two
        processes never both count the same free bytes: the decoded files never exceed the limit, not
        even for a moment. Downloads and decoding happen before, outside the lock, in parallel.
        """
        need = self.decoded_size(arrays)
        limit = self.cache_limit
        if limit is not None and need > limit:
            raise CacheLimitError(f"cache_limit={limit} bytes is smaller than one decoded shard ({shard.name}: "
                                  f"{need} bytes); raise cache_limit")
        deadline = time.monotonic() + self.wait_timeout
        while True:
            with self._room_lock():
                total = self._make_room(need, exclude=path) if limit is not None else 0
                if limit is None or total + need <= limit:
                    with self._handoff:
                        self._fresh[path] = arrays
                        self._handoff.notify_all()
                    write_decoded(path, arrays, shard_sha256=shard.sha256)
                    return True
            if not wait:
                return False
            own = self._held_bytes
            if own + need > limit or time.monotonic() > deadline:
                alone = own + need > limit
                who = "this process alone" if alone else "live readers on this node"
                raise CacheLimitError(
                    f"cache_limit={limit} bytes cannot hold the working set: {who} hold {own if alone else total} "
                    f"bytes of decoded shards in {self.cache_root} and shard {shard.name} needs {need} more. Raise "
                    "cache_limit or lower shuffle_window: every reader process of the node (each rank, and each "
                    "DataLoader worker of a rank) holds the shards of its current and next shuffle window, so a "
                    "node needs about readers x (shuffle_window / samples_per_shard + 2) decoded shards")
            time.sleep(0.05)  # readers hold every evictable shard: wait for one to move on

    @contextlib.contextmanager
    def _room_lock(self):
        if self.cache_limit is None:  # nothing to count: no need to serialise the node's writers
            yield
            return
        fd = os.open(os.path.join(self.cache_root, ROOM_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _make_room(self, need: int, *, exclude: str) -> int:
        """Evict least recently used unheld shards until `need` more bytes fit; returns the bytes left."""
        entries = sorted(e for e in self._scan() if e[2] != exclude)
        total = sum(size for _, size, _ in entries)
        for _, size, victim in entries:  # oldest use first
            if total + need <= self.cache_limit:
                break
            if self._try_evict(victim):
                total -= size
        return total
