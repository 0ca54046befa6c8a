"""The node-local cache directory and the dataset's manifest, fetched once per node through it.

Core, not loader: the trainer checks a dataset's manifest before it builds a loader, and both go through
the node's copy, so the directory rules (private, per-user) and the once-per-node fetch live here, below
the loaders (`shardkit.loaders.cache.shard_cache` keeps the shards in the same directories).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from shardkit.block_indexes import BLOCK_INDEXES_NAME, BlockIndexes, load_block_indexes
from shardkit.errors import ManifestError
from shardkit.forking import LockFile
from shardkit.manifest import MANIFEST_NAME, Manifest, load_manifest, load_manifest_and_digest
from shardkit.shard_columns import INDEX_NAME
from shardkit.storage import Storage, atomic_path, write_file_atomic

logger = logging.getLogger(__name__)


class UnsafeCacheDirError(PermissionError):
    """A cache directory belongs to another user or others can write to it."""


def private_directory(path: str) -> None:
    """Create directory `path` with mode 0700 if missing; refuse it unless it is ours and only ours to write.

    Whoever can write a cache directory decides which tokens every reader of the node is served, so a
    directory owned by another user, or writable by group or others (sticky bit or not), is refused.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    uid = os.geteuid()
    link = os.lstat(path)
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (uid, 0):
        problem = f"a symbolic link owned by another user (uid {link.st_uid})"
    else:
        st = os.stat(path)
        if not stat.S_ISDIR(st.st_mode):
            problem = "not a directory"
        elif st.st_uid != uid:
            problem = f"owned by another user (uid {st.st_uid}, this process runs as uid {uid})"
        elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            who = "others" if st.st_mode & stat.S_IWOTH else "its group"
            problem = f"writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
        else:
            return
    raise UnsafeCacheDirError(
        f"refusing cache directory {path}: it is {problem}, so another user could plant decoded shards in it "
        "that would be served as training data. Pass cache_dir= (loader) or --cache-dir (trainer) a private "
        "directory of your own (shardkit creates a missing one with mode 0700), or chmod 700 it if it is yours")


def private_tree(root: str, directory: str) -> None:
    """Create or check every level from cache root `root` down to `directory` (see `private_directory`)."""
    parent = os.path.dirname(root)
    if parent and not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)  # above the root: not shardkit's to police
    levels = os.path.relpath(directory, root).split(os.sep)
    current = root
    private_directory(current)
    for level in levels if levels != ["."] else []:
        current = os.path.join(current, level)
        private_directory(current)


def default_cache_dir() -> str:
    """`$SHARDKIT_CACHE_DIR`, else a per-user directory under the system temp dir (node-local)."""
    return os.environ.get("SHARDKIT_CACHE_DIR") or os.path.join(tempfile.gettempdir(), f"shardkit-cache-{os.getuid()}")


def dataset_cache_key(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()[:16]


# -- the manifest, once per node -------------------------------------------------------------------
def fetch_manifest(storage: Storage, cache_dir: str | None = None, *, node_copy: bool = True) -> Manifest:
    """The dataset's manifest, fetched and checked once per node through the node cache (without
    `node_copy`, for a reader that keeps nothing on disk: read from the store by every process).

    The first process of the node (no record of the manifest there yet) takes the node's manifest lock (a
    flock, as for a shard) and downloads `shardkit.json`, the binary index and the shards' block indexes
    (`shardkit.blocks`; each when the dataset has one) at once, in one round trip: the GET of the JSON answers
    its identity too (size and ETag or mtime), so no HEAD comes first. It copies them into the cache with
    atomic renames, hashes the JSON once, and writes a record of identity, size and SHA-256 last, once the
    manifest passed every check. Every other process
    asks the store for the manifest's identity (one HEAD or stat) and compares it with the record: a
    changed manifest is fetched again the same way, under the lock; an unchanged one is read from the
    local copy, trusting the record's hash instead of hashing the JSON again, and its checks of that very
    index file (checksum, names) instead of repeating them: a thousand ranks on 125 nodes cost 125
    manifest GETs and 125 hashes, not 1,000. Every process memory-maps the node's private copy of the
    index, so its pages are shared by the node's processes (`shardkit.shard_columns.map_index_file`). A
    local dataset's JSON is read in place; its index is copied too, since a file that someone may rewrite
    in place must not be mapped. Errors name the store's URL.
    """
    if not node_copy:
        return load_manifest(storage)
    url = storage.url_of(MANIFEST_NAME)
    root = os.path.abspath(cache_dir or default_cache_dir())
    directory = os.path.join(root, dataset_cache_key(storage.url))
    private_tree(root, directory)  # the record below is trusted instead of a hash: nobody else may write it
    local = storage if storage.is_local else Storage(directory)
    index_copy = os.path.join(directory, INDEX_NAME)
    record_path = os.path.join(directory, MANIFEST_NAME + ".record")
    if not storage.is_local and not os.path.exists(record_path):
        first = _under_lock(directory, lambda: None if os.path.exists(record_path)
                            else _fetch_manifest_locked(storage, local, directory, record_path))
        if first is not None:
            return first
        # Another process of the node recorded it meanwhile: its copy is checked below, as any process checks it.
    identity = _manifest_identity(storage)
    record = _read_record(record_path, identity)
    if record is None:
        def fetch() -> Manifest | None:
            if _read_record(record_path, identity) is not None:  # another process may have just done it
                return None
            return _fetch_manifest_locked(storage, local, directory, record_path, identity)
        fetched = _under_lock(directory, fetch)
        if fetched is not None:
            return fetched
        record = _read_record(record_path, identity)
    size, digest, checked_index = record
    return load_manifest(local, display_url=url, known_digest=(size, digest), index_copy=index_copy,
                         checked_index=checked_index)


def _under_lock(directory: str, work: Callable[[], Manifest | None]) -> Manifest | None:
    """`work()` holding the node's manifest lock (waiting for it)."""
    download = LockFile(os.path.join(directory, MANIFEST_NAME + ".dl"))  # a fork must not hold it too
    try:
        download.lock()
        return work()
    finally:
        download.close()  # releases the lock


def _manifest_identity(storage: Storage) -> str:
    try:
        return storage.identity(MANIFEST_NAME)
    except FileNotFoundError as err:
        raise _no_dataset(storage) from err


def _no_dataset(storage: Storage) -> ManifestError:
    return ManifestError(f"no dataset at {storage.display_url}: {MANIFEST_NAME} not found "
                         "(was the build interrupted before it finished?)")


def _fetch_manifest_locked(storage: Storage, local: Storage, directory: str, record_path: str,
                           identity: str | None = None) -> Manifest:
    """The node's process holding the manifest lock: download, hash and fully check the manifest, then record it
    under `identity` (a local dataset's, asked before), or under the identity the GET of the JSON answered."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(record_path)  # the copies below are being replaced: invalid until rewritten
    # The JSON (remote datasets; a local one is read in place) and the index at once: one round trip before the
    # first batch. The JSON's identity comes with its bytes (`Storage.download_with_identity`); the index records
    # the JSON it was built for and is checked against it, so it may come from any moment. A process still
    # reading the previous index copy keeps its mapping of that file: the rename gives this one a new inode. A
    # local dataset's JSON is read in place, so there is nothing to overlap the index copy with: a thread would
    # only add its start-up (milliseconds on a busy node) to the first batch.
    if storage.is_local:
        _download_optional(storage, INDEX_NAME, directory)
    else:
        with ThreadPoolExecutor(2, thread_name_prefix="shardkit-manifest") as pool:
            extras = [pool.submit(_download_optional, storage, name, directory)
                      for name in (INDEX_NAME, BLOCK_INDEXES_NAME)]
            try:
                identity = _download_atomic(storage, MANIFEST_NAME, directory, identity=True, asked=identity)
                for extra in extras:
                    extra.result()
            except FileNotFoundError as err:
                raise _no_dataset(storage) from err
            finally:
                # The future keeps an error, whose traceback keeps this frame and its callers': a reference
                # cycle that would hold the caller's objects (a DataLoader and its workers) until a collection.
                extras = None
    logger.debug("fetched the manifest of %s (JSON %s) into the node cache %s", storage.display_url,
                 "copied" if not storage.is_local else "read in place", directory)
    manifest, (size, digest), checked_index = load_manifest_and_digest(
        local, display_url=storage.url_of(MANIFEST_NAME), index_copy=os.path.join(directory, INDEX_NAME))
    write_file_atomic(record_path, json.dumps([identity, size, digest, checked_index]).encode(), fsync=False)
    return manifest


def _read_record(path: str, identity: str) -> tuple[int, str, str | None] | None:
    """(size, SHA-256, checked index stamp) of the node's manifest copy when its record is for
    `identity`, else None."""
    try:
        with open(path) as fh:
            recorded, size, digest, stamp = json.load(fh)
    except (FileNotFoundError, ValueError, TypeError):
        return None
    return (size, digest, stamp) if recorded == identity else None


def _download_optional(storage: Storage, name: str, directory: str) -> None:
    """The dataset's file `name` (its binary index, its block indexes) into `directory`, if it has one (one GET,
    not a HEAD and a LIST to ask first); a copy of an earlier manifest's is removed when it has none."""
    try:
        _download_atomic(storage, name, directory)
    except FileNotFoundError:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))


def node_block_indexes(storage: Storage, directory: str) -> BlockIndexes | None:
    """The shards' block indexes that `fetch_manifest` brought to the node with the manifest (a remote dataset's
    `shardkit.blocks`, in its node-cache `directory`), or None. Whichever manifest the copy came with, a reader
    takes from it only the indexes whose SHA-256 its own manifest records (`BlockIndexes.get`)."""
    if storage.is_local:
        return None  # its shards' indexes are local reads already
    return load_block_indexes(os.path.join(directory, BLOCK_INDEXES_NAME), source=storage.url_of(BLOCK_INDEXES_NAME))


def _download_atomic(storage: Storage, name: str, directory: str, *, identity: bool = False,
                     asked: str | None = None) -> str | None:
    """Copy `name` into `directory`; with `identity`, return the copy's (`Storage.download_with_identity`)."""
    # No fsync here or for the record: the node cache holds copies of the store, fetched again when lost.
    with atomic_path(os.path.join(directory, name), fsync=False) as temporary:
        if identity:
            return storage.download_with_identity(name, temporary, asked=asked)
        storage.download(name, temporary)
        return None
