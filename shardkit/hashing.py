"""SHA-256 of data too large to hold at once: the one streaming hash loop of the package.

`sha256_pieces` hashes any sequence of pieces (a file read piece by piece with `read_pieces`, or ranged
reads of a remote object) and counts their bytes; `file_sha256` is the hex digest of a local file. The
manifest, its binary index, the build and the tokenizer specs hash through them. This module imports
nothing of shardkit, so every core module can use it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

PIECE_BYTES = 1 << 20  # per read: bounded memory whatever the file's size, few calls


def read_pieces(fh: BinaryIO, size: int | None = None) -> Iterator[memoryview]:
    """The next `size` bytes of `fh` (up to its end when None), piece by piece, read into one buffer that
    is refilled: each piece is valid only until the next one is asked for (hash it, do not keep it)."""
    buffer = memoryview(bytearray(PIECE_BYTES))
    left = size
    while left is None or left > 0:
        count = fh.readinto(buffer if left is None else buffer[:min(left, PIECE_BYTES)])
        if not count:
            return
        yield buffer[:count]
        left = None if left is None else left - count


def sha256_pieces(pieces: Iterable[bytes | memoryview]) -> tuple[int, Any]:
    """(bytes hashed, SHA-256 object) of `pieces`, hashed as they come (hashlib releases the GIL)."""
    digest, size = hashlib.sha256(), 0
    for piece in pieces:
        digest.update(piece)
        size += len(piece)
    return size, digest


def file_sha256(path: str) -> str:
    """SHA-256 hex digest of the local file `path`."""
    with open(path, "rb", buffering=0) as fh:
        return sha256_pieces(read_pieces(fh))[1].hexdigest()
