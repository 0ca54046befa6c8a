"""`cache_mode` "decoded": each shard decompressed once per node and read through mmap.

`<cache_dir>/<16 hex of the dataset URL's SHA-256>/<shard name>.<16 hex of its SHA-256>.skd` holds a shard
decoded once (`write_decoded`) and read through mmap (`open_decoded`). One process of the node downloads,
verifies and decodes a shard under its download lock; the others wait for it (or, when prefetching, skip to
another shard, which spreads the downloads over the node's processes) and then find the finished file.
Readers hold a shared lock on each shard they use (`shardkit.loaders.cache.directory` has the lock protocol),
and with `cache_limit` the least recently used unheld shards are evicted to make room; when the shards held
by live readers leave no room, the store waits up to `wait_timeout` seconds for readers to move on, then
raises `CacheLimitError`.

Downloads go through the core's one verified read (`shardkit.formats.fetch.read_shard`): bytes are checked
against the manifest's size and SHA-256 while they decode, a mismatch gets one re-read, then
`CorruptShardError` naming the shard's URL. Each decoded file records the SHA-256 of the shard it came from
and a CRC-32 of its bytes (`shardkit.formats.decoded`); a file that fails either check on open (stale,
truncated, damaged) is removed with a warning naming it and decoded again, never served.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time

from shardkit import metrics
from shardkit.errors import CorruptShardError
from shardkit.forking import LockFile
from shardkit.formats import (
    ShardArrays,
    ShardReader,
    check_decoded,
    decode_shard,
    open_decoded,
    read_shard,
    write_decoded,
)
from shardkit.manifest import ShardInfo

from .directory import (
    CacheLimitError,
    exclusive_lock,
    make_room,
    remove_stale_temporaries,
    room_lock,
)
from .block_reader import BlockReader
from .store import CachedShard, Release, StoreContext, claim_download

logger = logging.getLogger(__name__)

# Decoded files hold a header (well under 1 KiB) and 64-byte-aligned arrays.
_HEADER_BOUND = 1024


def decoded_size(arrays: ShardArrays) -> int:
    """Size of the decoded file of `arrays` (an upper bound, exact to the header padding)."""
    parts = (arrays.tokens, arrays.sample_offsets, arrays.doc_offsets, arrays.doc_starts, arrays.doc_source,
             arrays.doc_index)
    return _HEADER_BOUND + sum(-(-a.nbytes // 64) * 64 for a in parts if a is not None)


class DecodedStore:
    """Shards decoded once per node into `.skd` files, mapped by every reader (see the module docstring).

    Args:
        context: the dataset, its cache directory, limit and counters.
    """

    on_disk = True  # keeps files in the node's cache directory (`keeps_node_files`)
    keeps_bytes = False  # a shard completed block by block is stored from its decoded arrays

    def __init__(self, context: StoreContext):
        self._context = context
        self._held_bytes = 0  # decoded bytes this process holds open (the limit cannot evict them)
        self._lock = threading.Lock()

    def contains(self, index: int) -> bool:
        """Whether the decoded file of shard `index` exists."""
        return os.path.exists(self._context.path(index))

    def lookup(self, index: int) -> CachedShard:
        """Hold shard `index` (shared reader lock), downloading it first if no process of the node has."""
        context = self._context
        shard, path = context.manifest.shards[index], context.path(index)
        context.private_dirs(path)
        reading = LockFile(path + ".lock")
        try:
            reading.lock(shared=True)
            fresh = None
            if os.path.exists(path):
                context.stats.hits += 1
                metrics.cache_lookup(context.url, hit=True)
            else:
                metrics.cache_lookup(context.url, hit=False)
                fresh = context.handoff.wait(path)
                if fresh is None:
                    self._fetch(shard, path, block=True)
            if fresh is not None:
                reader, nbytes = ShardReader(fresh, name=shard.name), decoded_size(fresh)
            else:
                # The lock file's mtime is the last use (eviction is least recently used); the decoded
                # file's own mtime stays its write time, part of the identity its CRC check is kept under.
                os.utime(reading.fd)
                reader = self._open_bound(shard, path)
                nbytes = os.path.getsize(path)
        except BaseException:
            reading.close()
            raise
        with self._lock:
            self._held_bytes += nbytes
        metrics.inc("shardkit_cache_held_bytes", nbytes)
        return CachedShard(reader, self, nbytes=nbytes, release=functools.partial(self._release, reading, nbytes))

    def _release(self, reading: LockFile, nbytes: int) -> None:
        reading.close()  # releases the shared lock: eviction may remove the shard again
        with self._lock:
            self._held_bytes -= nbytes
        metrics.inc("shardkit_cache_held_bytes", -nbytes)

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
        with exclusive_lock(path + ".dl"), contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == found.st_ino:
                os.unlink(path)
        self._fetch(shard, path, block=True)
        return ShardReader(open_decoded(path, shard=shard.name, shard_sha256=shard.sha256), name=shard.name)

    def prefetch(self, index: int) -> bool:
        """Fetch shard `index` unless another process is already fetching it; True when cached."""
        path = self._context.path(index)
        if os.path.exists(path):
            return True
        self._context.private_dirs(path)
        try:
            return self._fetch(self._context.manifest.shards[index], path, block=False)
        except CacheLimitError:
            return False  # no room now: the reader will fetch it when it needs it

    def claim(self, index: int) -> Release | None:
        """This process completes shard `index` when it holds the node's download lock of it."""
        return claim_download(self._context, index)

    def put(self, index: int, arrays: ShardArrays, data: bytes | memoryview | None) -> None:
        """Write the decoded file of a shard completed block by block (the caller holds the download lock)."""
        shard, path = self._context.manifest.shards[index], self._context.path(index)
        try:
            if not os.path.exists(path):
                remove_stale_temporaries(path)
                self._admit(path, arrays, shard=shard, wait=False)
        except CacheLimitError as err:
            logger.debug("shard %s not stored in the cache: %s", shard.name, err)

    def abandon(self, partial: BlockReader) -> None:
        """Finish and store the shard: a reader that stops early (an abandoned iterator, a first-batch
        check) may hold the node's download lock of it, and without this the node's readers would read it
        block by block in every epoch and no process of the node would ever store it."""
        partial.start_completion()

    # -- downloading ---------------------------------------------------------------------------
    def _fetch(self, shard: ShardInfo, path: str, *, block: bool) -> bool:
        handoff = self._context.handoff
        download = LockFile(path + ".dl")
        handoff.begin(path)
        try:
            if not download.lock(wait=block):
                return False
            if os.path.exists(path):
                return True  # another process finished it while we waited
            remove_stale_temporaries(path)
            arrays = self._download(shard)
            return self._admit(path, arrays, shard=shard, wait=block)
        finally:
            handoff.end(path)
            download.close()

    def _download(self, shard: ShardInfo) -> ShardArrays:
        context = self._context
        manifest = context.manifest
        download_started = time.perf_counter()

        def decode(data: bytes) -> ShardArrays:
            started = time.perf_counter()
            arrays = decode_shard(data, shard_format=manifest.shard_format, token_dtype=manifest.token_dtype,
                                  shard=shard.name, raw_bytes=shard.raw_bytes)
            metrics.shard_decoded(context.url, manifest.shard_format, time.perf_counter() - started)
            return arrays

        def count(nbytes: int) -> None:
            nonlocal download_started
            context.stats.count_download(nbytes)
            metrics.shard_downloaded(context.url, manifest.shard_format, nbytes,
                                     time.perf_counter() - download_started)
            download_started = time.perf_counter()

        arrays = read_shard(context.storage_of(), shard, decode=decode, on_read=count)
        check_decoded(arrays, shard, vocab_size=manifest.tokenizer.vocab_size)
        return arrays

    def _admit(self, path: str, arrays: ShardArrays, *, shard: ShardInfo, wait: bool) -> bool:
        """Write the decoded shard once the limit has room for it; False when not `wait` and no room.

        Making room and writing happen under one node-wide lock (`ROOM_LOCK` in the cache root), so two
        processes never both count the same free bytes: the decoded files never exceed the limit, not
        even for a moment. Downloads and decoding happen before, outside the lock, in parallel.
        """
        context = self._context
        need = decoded_size(arrays)
        limit = context.cache_limit
        if limit is not None and need > limit:
            raise CacheLimitError(f"cache_limit={limit} bytes is smaller than one decoded shard ({shard.name}: "
                                  f"{need} bytes); raise cache_limit")
        deadline = time.monotonic() + context.wait_timeout
        while True:
            with room_lock(context.cache_root, limit is not None):
                total = 0
                if limit is not None:
                    total, evicted = make_room(context.cache_root, need, limit, exclude=path)
                    context.stats.evictions += evicted
                if limit is None or total + need <= limit:
                    context.handoff.offer(path, arrays)
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
                    f"bytes of decoded shards in {context.cache_root} and shard {shard.name} needs {need} more. "
                    "Raise cache_limit or lower shuffle_window: every reader process of the node (each rank, and "
                    "each DataLoader worker of a rank) holds the shards of the samples it reads now and of those it "
                    "reads next (chunk_samples each, drawn from up to two shuffle windows), so a node needs at most "
                    "about readers x (shuffle_window / samples_per_shard + 2) decoded shards")
            time.sleep(0.05)  # readers hold every evictable shard: wait for one to move on
