"""The one verified shard read: every reader (the loader's cache, `verify`, `cat`) calls `read_shard`,
and for format v2 shards read a block at a time, `read_block_index` then `read_block`.

`Storage` retries failed requests; it cannot know that a successful read returned the wrong bytes
(a flipped bit in transit on a store or range read without end-to-end checksums, a truncated body a
proxy passed as complete). The manifest's size and SHA-256 can: bytes that fail them are read once
more (`SHARD_READS`), and a shard that fails again is refused with an error naming its URL, so one
bad read is never reported as a corrupt shard, and a corrupt shard is never returned.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from shardkit.errors import CorruptShardError
from shardkit.formats.blocks import Block, BlockIndex, check_block_bytes
from shardkit.formats.shard_bytes import check_shard_bytes
from shardkit.manifest import ShardInfo
from shardkit.storage import Storage

logger = logging.getLogger(__name__)

# Reads of one shard before it is called corrupt: the first, and one re-read after a mismatch. A
# transient fault that Storage sees (an error, a reset) is retried there, within its own budget; a
# second read with the wrong bytes means the stored object itself differs from the manifest.
SHARD_READS = 2


def read_shard(storage: Storage, shard: ShardInfo, *, decode: Callable[[bytes], Any] | None = None,
               reads: int = SHARD_READS, on_read: Callable[[int], None] | None = None) -> Any:
    """The bytes of `shard` (or `decode(bytes)`), checked against its manifest size and SHA-256.

    Args:
        storage: the dataset prefix.
        shard: the manifest's entry (name, size, SHA-256).
        decode: optional; runs while the bytes are hashed (hashlib releases the GIL), and its result
            is returned only when the hash matches. It must be safe on untrusted bytes (the shard
            decoders are: bounded by the manifest's sizes, strict parsing).
        reads: reads before giving up (`SHARD_READS` by default).
        on_read: called with the byte count of every read (for download statistics).

    Raises:
        CorruptShardError: every read failed the check (the message names the shard's URL), or the
            bytes match the manifest yet do not decode.
        StorageError, FileNotFoundError: the storage itself failed past its retry budget.
    """
    if reads < 1:
        raise ValueError(f"reads must be >= 1, got {reads}")
    url = storage.url_of(shard.name)
    reason = ""
    for attempt in range(1, reads + 1):
        data = storage.read_bytes(shard.name, size=shard.compressed_bytes)
        if on_read is not None:
            on_read(len(data))
        check_error, result = _check_while_decoding(data, shard, url, decode)
        if check_error is None:
            return result
        reason = check_error.reason
        logger.warning("shard %s failed its check (read %d/%d): %s", url, attempt, reads, reason)
    raise CorruptShardError(url, f"{reason} on each of {reads} reads: the stored object is corrupt or was "
                                 "replaced; rebuild the dataset or restore the shard")


def _check_while_decoding(data: bytes, shard: ShardInfo, url: str,
                          decode: Callable[[bytes], Any] | None) -> tuple[CorruptShardError | None, Any]:
    """(check error or None, decoded value or the bytes); a decode error counts only if the bytes pass."""
    errors: list[CorruptShardError] = []

    def check() -> None:
        try:
            check_shard_bytes(data, shard=url, sha256=shard.sha256, size=shard.compressed_bytes)
        except CorruptShardError as err:
            # Without its traceback, which holds this frame and so `errors`: no reference cycle.
            errors.append(err.with_traceback(None))

    if decode is None:
        check()
        return (errors[0], None) if errors else (None, data)
    hasher = threading.Thread(target=check, name="shardkit-hash", daemon=True)
    hasher.start()
    # The decode error is never kept in a local: its traceback holds this frame, and with it every caller's
    # (a reference cycle that would keep a DataLoader and its workers alive until a collection).
    try:
        decoded = decode(data)
    except CorruptShardError:
        hasher.join()
        if errors:
            return errors[0], None  # the bytes are not what the manifest promised: the read is the culprit
        raise  # the bytes are what the manifest promised, yet undecodable: a re-read cannot help
    hasher.join()
    if errors:
        return errors[0], None
    return None, decoded


def read_block_index(storage: Storage, shard: ShardInfo, *, reads: int = SHARD_READS,
                     on_read: Callable[[int], None] | None = None, held: bytes | None = None) -> BlockIndex:
    """The block index of a format v2 shard (one ranged read), checked against the manifest's
    `index_sha256` (one re-read on a mismatch, then `CorruptShardError` naming the shard's URL).

    `held` is the index already at hand (the dataset's `shardkit.blocks`, `shardkit.block_indexes`): checked as
    a read is, and no request is made unless it fails the check."""
    url = storage.url_of(shard.name)
    start, end = shard.index_offset, shard.index_offset + shard.index_bytes

    def check(data: bytes) -> None:
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != shard.index_bytes or digest != shard.index_sha256:
            raise CorruptShardError(url, f"block index (bytes {start}-{end}): {len(data)} bytes with sha256 "
                                         f"{digest}, the manifest says {shard.index_bytes} with {shard.index_sha256}")

    data = _read_checked_range(storage, shard.name, start, end, check, reads=reads, on_read=on_read, first=held)
    return BlockIndex.from_bytes(data, shard=url, samples=shard.samples, tokens=shard.tokens,
                                 raw_bytes=shard.raw_bytes, index_offset=shard.index_offset)


def read_block(storage: Storage, shard: ShardInfo, block: Block, number: int, *, reads: int = SHARD_READS,
               on_read: Callable[[int], None] | None = None, data: bytes | None = None) -> bytes:
    """The bytes of one block, checked against its SHA-256 from the (verified) block index.

    `data` is a first read the caller already holds (a coalesced range): it is checked, and read again
    only on a mismatch. Bytes that fail every read raise `CorruptShardError` naming the shard's URL and
    the block; they are never returned.
    """
    url = storage.url_of(shard.name)

    def check(candidate: bytes) -> None:
        check_block_bytes(candidate, block, shard=url, number=number)

    return _read_checked_range(storage, shard.name, block.byte_start, block.byte_end, check, reads=reads,
                               on_read=on_read, first=data)


def _read_checked_range(storage: Storage, name: str, start: int, end: int, check: Callable[[bytes], None], *,
                        reads: int, on_read: Callable[[int], None] | None, first: bytes | None = None) -> bytes:
    if reads < 1:
        raise ValueError(f"reads must be >= 1, got {reads}")
    url = storage.url_of(name)
    error: CorruptShardError | None = None
    for attempt in range(1, reads + 1):
        if attempt == 1 and first is not None:
            data = first
        else:
            data = storage.read_range(name, start, end)
            if on_read is not None:
                on_read(len(data))
        try:
            check(data)
            return data
        except CorruptShardError as err:
            error = err
            logger.warning("shard %s failed its check (read %d/%d): %s", url, attempt, reads, err.reason)
    raise CorruptShardError(url, f"{error.reason} on each of {reads} reads: the stored object is corrupt or was "
                                 "replaced; rebuild the dataset or restore the shard")
