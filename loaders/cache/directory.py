"""The node cache directory: shard file names, `flock` locks, temporaries, and LRU eviction under `cache_limit`.

Coordination between the node's processes uses only `flock` locks on small companion files, which the
kernel releases when a process dies, so a crashed or SIGKILLed process can never block or poison the others:

- `<file>.dl`: exclusive while one process downloads, verifies and decodes (or completes block by block)
  the shard. Finished files appear by atomic rename only, and the holder removes the temporaries a dead
  predecessor left behind.
- `<file>.lock`: shared while a reader holds a decoded shard open. Eviction takes it exclusive without
  waiting, so it only ever removes shards that no live reader holds.
- `<cache root>/.room.lock` (with `cache_limit` only): exclusive while one process evicts to make room and
  writes a decoded shard, so the decoded files never exceed the limit even for a moment.

The directories themselves are private (`shardkit.node_cache.private_tree`: mode 0700, refused otherwise).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from shardkit import metrics
from shardkit.forking import LockFile
from shardkit.manifest import ShardInfo
from shardkit.names import check_relative_name
from shardkit.storage import TEMPORARY_MARK

DECODED_SUFFIX = ".skd"
COMPRESSED_SUFFIX = ".skz"
ROOM_LOCK = ".room.lock"  # in the cache root: held while one process makes room and admits a shard


class CacheLimitError(OSError):
    """`cache_limit` is too small for the shards that live readers need at the same time."""


def shard_file(directory: str, shard: ShardInfo, suffix: str) -> str:
    """`<directory>/<shard name>.<16 hex of its SHA-256><suffix>`, never outside `directory`: naming the
    file after the shard's hash means a rebuilt dataset never reads stale data."""
    relative = check_relative_name(f"{shard.name}.{shard.sha256[:16]}{suffix}", what="shard name")
    full = os.path.normpath(os.path.join(directory, relative))
    if not full.startswith(directory + os.sep):
        raise ValueError(f"shard name {shard.name!r} would leave the cache directory {directory}")
    return full


# -- locks -----------------------------------------------------------------------------------------
# Every lock file is opened as a `LockFile`: a DataLoader worker forked while a thread of its parent holds a
# lock must not hold it too (`shardkit.forking`).
@contextlib.contextmanager
def exclusive_lock(path: str) -> Iterator[None]:
    """Hold the exclusive `flock` of lock file `path` (waiting for it)."""
    lock = LockFile(path)
    try:
        lock.lock()
        yield
    finally:
        lock.close()  # releases the lock


def try_exclusive_lock(path: str) -> LockFile | None:
    """The lock file `path` holding its exclusive `flock`, or None when another holds it (`close()` releases
    the lock)."""
    lock = LockFile(path)
    if not lock.lock(wait=False):
        lock.close()
        return None
    return lock


# -- files -----------------------------------------------------------------------------------------
def remove_stale_temporaries(path: str) -> None:
    """Remove the temporaries of `path` a dead writer left (call with the download lock of `path` held)."""
    # Only the holder of the download lock writes temporaries for this shard, so any that
    # exist were left by a process that died mid-write.
    directory, prefix = os.path.dirname(path), os.path.basename(path) + TEMPORARY_MARK
    for name in os.listdir(directory):
        if name.startswith((prefix, "." + prefix)):  # the second: the hidden spelling of older versions
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass


# -- eviction (decoded files only: `cache_limit` counts the `.skd` files) ---------------------------
def _scan_decoded(cache_root: str) -> list[tuple[float, int, str]]:
    """(last use, size, path) of every decoded file under `cache_root` (all datasets)."""
    entries = []
    for directory, _, names in os.walk(cache_root):
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


def _try_evict(path: str) -> bool:
    """Remove decoded file `path` unless a live reader holds it; True when removed."""
    try:
        lock = try_exclusive_lock(path + ".lock")
    except FileNotFoundError:
        return False
    if lock is None:
        return False  # a live reader holds it
    try:
        os.unlink(path)
        metrics.inc("shardkit_cache_evictions_total")
        return True
    except FileNotFoundError:
        return False
    finally:
        lock.close()


@contextlib.contextmanager
def room_lock(cache_root: str, limited: bool) -> Iterator[None]:
    """Hold the node's room lock while making room and writing (only under a limit: with none there is
    nothing to count, so no need to serialise the node's writers)."""
    if not limited:
        yield
        return
    with exclusive_lock(os.path.join(cache_root, ROOM_LOCK)):
        yield


def make_room(cache_root: str, need: int, limit: int, *, exclude: str) -> tuple[int, int]:
    """Evict least recently used unheld decoded files until `need` more bytes fit under `limit`.

    Returns:
        (bytes of decoded files left, files evicted).
    """
    entries = sorted(e for e in _scan_decoded(cache_root) if e[2] != exclude)
    total = sum(size for _, size, _ in entries)
    evicted = 0
    for _, size, victim in entries:  # oldest use first
        if total + need <= limit:
            break
        if _try_evict(victim):
            total -= size
            evicted += 1
    return total, evicted
