"""Verified shard transfer: bytes that do not match the manifest are read again, never returned.

`Storage` retries failed requests; it cannot know that a successful read returned the wrong bytes
(a flipped bit in transit on a store or range read without end-to-end checksums, a truncated body a
proxy passed as complete). The manifest's size and SHA-256 can: a shard that fails them is read
again, up to `attempts` times, and then refused with an error naming its URL.
"""

from __future__ import annotations

import hashlib
import logging
import os
import uuid

from shardkit.errors import CorruptShardError
from shardkit.formats.shard_bytes import check_shard_bytes
from shardkit.manifest import ShardInfo
from shardkit.storage import Storage

logger = logging.getLogger(__name__)

DEFAULT_ATTEMPTS = 3
_CHUNK = 1 << 20


def _give_up(url: str, attempts: int, reason: str) -> CorruptShardError:
    return CorruptShardError(url, f"{reason} on each of {attempts} reads: the stored object is corrupt or was "
                                  "replaced; rebuild the dataset or restore the shard")


def read_shard(storage: Storage, shard: ShardInfo, *, attempts: int = DEFAULT_ATTEMPTS) -> bytes:
    """The bytes of `shard`, checked against its manifest size and SHA-256.

    Raises:
        CorruptShardError: every read failed the check; the message names the shard's URL.
        StorageError: the storage itself failed past its retry budget.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    url = storage.url_of(shard.name)
    reason = ""
    for attempt in range(1, attempts + 1):
        data = storage.read_bytes(shard.name, size=shard.compressed_bytes)
        try:
            check_shard_bytes(data, shard=url, sha256=shard.sha256, size=shard.compressed_bytes)
            return data
        except CorruptShardError as err:
            reason = err.reason
            logger.warning("shard %s failed its check (read %d/%d): %s", url, attempt, attempts, reason)
    raise _give_up(url, attempts, reason)


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def download_shard(storage: Storage, shard: ShardInfo, local_path: str, *, attempts: int = DEFAULT_ATTEMPTS) -> None:
    """Download `shard` to `local_path`, which appears (atomically, by rename) only once verified.

    The temporary file lives beside `local_path`, so a process killed mid-download leaves at most
    a `.tmp-*` file that nothing ever reads as a shard.

    Raises:
        CorruptShardError: every download failed the check; the message names the shard's URL.
        StorageError: the storage itself failed past its retry budget.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    url = storage.url_of(shard.name)
    directory = os.path.dirname(local_path) or "."
    reason = ""
    for attempt in range(1, attempts + 1):
        tmp = os.path.join(directory, f".{os.path.basename(local_path)}.tmp-{uuid.uuid4().hex}")
        try:
            storage.download(shard.name, tmp)
            size = os.path.getsize(tmp)
            digest = file_sha256(tmp) if size == shard.compressed_bytes else None
            if digest == shard.sha256:
                os.replace(tmp, local_path)
                return
            reason = (f"size is {size} bytes, the manifest says {shard.compressed_bytes}" if digest is None
                      else f"sha256 is {digest}, the manifest says {shard.sha256}")
            logger.warning("shard %s failed its check (download %d/%d): %s", url, attempt, attempts, reason)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise _give_up(url, attempts, reason)
