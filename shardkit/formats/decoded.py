"""The decoded-shard file: a shard decompressed once into the local cache and read through mmap.

Layout (little-endian):

    b"SKDECODE"               8-byte magic
    header length             uint64
    header                    UTF-8 JSON: {"version": 2, "shard_sha256": HEX or null,
                              "arrays": {name: {"dtype", "offset", "count"}}}
    arrays                    each starting at a 64-byte-aligned offset
    trailer                   b"SKDCRC32" + uint32 CRC-32 of every byte before the trailer + 4 zero bytes

Opening maps the file once and returns `ShardArrays` whose arrays are zero-copy numpy views of the
mapping: reading a sample is pointer arithmetic, with no per-sample decode. The file is written to a
temporary name and renamed, so a reader never maps a partial file.

The header binds the file to the compressed shard it was decoded from (`shard_sha256`, the manifest's
hash of that shard) and the trailer's CRC-32 covers the magic, the header and the arrays: opening with
`shard_sha256=` refuses a file decoded from another shard (stale) and one whose bytes changed since they
were written (truncated, damaged, edited). CRC-32 rather than a cryptographic hash because it runs at
memory speed (zlib, ~3.5 GB/s here); it is not a defence against someone who can write the cache
directory, which is why the loader's cache refuses such directories.

The CRC and the arrays' structure are checked once per file identity (device, inode, size, modification time) per process, not at
every open: an epoch reopens every shard, and re-reading every byte of it cost a seventh of a warm epoch.
A file that is replaced (a rename gives a new inode), truncated, extended or written in place (a write
sets the modification time) has another identity and is checked again, so a damaged or forged file is
still never served.
"""

from __future__ import annotations

import json
import os
import struct
import zlib

import numpy as np

from shardkit.errors import CorruptShardError
from shardkit.formats.sample import ShardArrays
from shardkit.storage import atomic_path

MAGIC = b"SKDECODE"
VERSION = 2
ALIGN = 64
TRAILER_MAGIC = b"SKDCRC32"
TRAILER = struct.Struct("<8sI4x")  # magic, CRC-32 of everything before the trailer, padding to 16 bytes
_ARRAY_NAMES = ("tokens", "sample_offsets", "doc_offsets", "doc_starts", "doc_source", "doc_index")
_ALLOWED_DTYPES = {"<u2", "<u4", "<i4", "<i8"}
_CRC_CHUNK = 64 << 20  # bounds the bytes one crc32 call reads (it releases the GIL meanwhile)
_MAX_VERIFIED = 1 << 16  # identities remembered per process (a few MB at most)
# (device, inode, size, mtime_ns) of the decoded files whose CRC this process checked.
_verified: set[tuple[int, int, int, int]] = set()


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def write_decoded(path: str, arrays: ShardArrays, *, shard_sha256: str | None = None) -> int:
    """Write `arrays` to `path` atomically (tmp file + rename); returns the file size.

    Args:
        shard_sha256: the manifest's SHA-256 of the compressed shard `arrays` were decoded from;
            `open_decoded(..., shard_sha256=...)` then refuses the file for any other shard.
    """
    present = [(n, getattr(arrays, n)) for n in _ARRAY_NAMES if getattr(arrays, n) is not None]
    # Offsets depend on the header length, which depends on the offsets: fix the header size first
    # by formatting offsets as zero-padded 20-digit numbers.
    entries, cursor = {}, 0
    for name, array in present:
        entries[name] = {"dtype": array.dtype.str, "offset": cursor, "count": int(array.size)}
        cursor += -(-array.nbytes // ALIGN) * ALIGN

    def header_json(arrays_entries: dict) -> str:
        return json.dumps({"version": VERSION, "shard_sha256": shard_sha256, "arrays": arrays_entries})

    probe = header_json({n: {**e, "offset": 10**19} for n, e in entries.items()})
    data_start = -(-(len(MAGIC) + 8 + len(probe)) // ALIGN) * ALIGN
    for entry in entries.values():
        entry["offset"] += data_start
    header = header_json(entries).encode()
    header = header + b" " * (data_start - len(MAGIC) - 8 - len(header))
    # No fsync: a decoded file is a cache of its shard, decoded again when lost, refused by its CRC when cut short.
    with atomic_path(path, fsync=False) as temporary, open(temporary, "xb") as fh:
        head = MAGIC + struct.pack("<Q", len(header)) + header
        fh.write(head)
        crc = zlib.crc32(head)
        for name, array in present:
            # Padding is written (not skipped with seek) so that the CRC covers exactly the bytes on disk.
            gap = bytes(entries[name]["offset"] - fh.tell())
            payload = memoryview(np.ascontiguousarray(array)).cast("B")
            fh.write(gap)
            fh.write(payload)
            crc = zlib.crc32(payload, zlib.crc32(gap, crc))
        tail = bytes(data_start + cursor - fh.tell())
        fh.write(tail)
        fh.write(TRAILER.pack(TRAILER_MAGIC, zlib.crc32(tail, crc)))
    return os.path.getsize(path)


def open_decoded(path: str, *, shard: str | None = None, shard_sha256: str | None = None) -> ShardArrays:
    """Map a decoded-shard file; returns zero-copy views.

    Args:
        shard: the shard's name, for error messages.
        shard_sha256: when given, the file must have been written for the shard with this SHA-256.

    Raises:
        CorruptShardError: the file is malformed, truncated, damaged (CRC-32), of an older format, or
            (with `shard_sha256`) decoded from another shard.
    """
    label = shard or path
    with open(path, "rb") as fh:
        # The identity and the mapping come from one open file, so the bytes checked (or known to be
        # checked) are the bytes mapped, even if the path is replaced meanwhile.
        identity = _identity(os.fstat(fh.fileno()))
        size = identity[2]
        if size < len(MAGIC) + 8 + TRAILER.size:
            raise CorruptShardError(label, f"decoded cache file {path} is truncated")
        # Plain ndarray views of the np.memmap (which they keep alive through .base): the memmap subclass
        # adds ~1 us of Python overhead to every slice and fancy index, a third of a batch gather.
        mapped = np.memmap(fh, dtype=np.uint8, mode="r").view(np.ndarray)
    if bytes(mapped[:8]) != MAGIC:
        raise CorruptShardError(label, f"{path} is not a shardkit decoded-shard file")
    (header_len,) = struct.unpack("<Q", bytes(mapped[8:16]))
    end = size - TRAILER.size  # the arrays end where the trailer starts
    if 16 + header_len > end:
        raise CorruptShardError(label, f"decoded cache file {path} has a truncated header")
    try:
        header = json.loads(bytes(mapped[16:16 + header_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptShardError(label, f"decoded cache file {path} has an unreadable header") from err
    if not isinstance(header, dict) or header.get("version") != VERSION or not isinstance(header.get("arrays"), dict):
        found = header.get("version") if isinstance(header, dict) else "?"
        raise CorruptShardError(label, f"decoded cache file {path}: unsupported header (version {found}, "
                                       f"expected {VERSION})")
    if shard_sha256 is not None and header.get("shard_sha256") != shard_sha256:
        raise CorruptShardError(label, f"decoded cache file {path} was decoded from another shard (SHA-256 "
                                       f"{str(header.get('shard_sha256'))[:16]}..., expected {shard_sha256[:16]}...)")
    checked = identity in _verified
    if not checked:
        _check_crc(mapped, end, path, label)
    entries = header["arrays"]
    views: dict[str, np.ndarray | None] = dict.fromkeys(_ARRAY_NAMES)
    for name, entry in entries.items():
        dtype, offset, count = entry.get("dtype"), entry.get("offset"), entry.get("count")
        if name not in views or dtype not in _ALLOWED_DTYPES or not isinstance(offset, int) or not isinstance(count, int):
            raise CorruptShardError(label, f"decoded cache file {path}: bad array entry {name!r}")
        nbytes = count * np.dtype(dtype).itemsize
        if offset < 16 + header_len or offset + nbytes > end or count < 0:
            raise CorruptShardError(label, f"decoded cache file {path}: array {name} lies outside the file")
        views[name] = mapped[offset:offset + nbytes].view(dtype)
    if views["tokens"] is None or views["sample_offsets"] is None:
        raise CorruptShardError(label, f"decoded cache file {path} lacks tokens or offsets")
    arrays = ShardArrays(**views)
    if not checked:  # the same bytes passed both checks in this process (O(samples): a tenth of an epoch start)
        arrays.validate(label)
        if len(_verified) >= _MAX_VERIFIED:
            _verified.clear()
        _verified.add(identity)
    return arrays


def _check_crc(mapped: np.ndarray, end: int, path: str, label: str) -> None:
    magic, expected = TRAILER.unpack(bytes(mapped[end:end + TRAILER.size]))
    if magic != TRAILER_MAGIC:
        raise CorruptShardError(label, f"decoded cache file {path} is truncated (no trailer)")
    crc = 0
    for start in range(0, end, _CRC_CHUNK):
        crc = zlib.crc32(mapped[start:min(end, start + _CRC_CHUNK)], crc)
    if crc != expected:
        raise CorruptShardError(label, f"decoded cache file {path} is damaged (CRC-32 {crc:08x}, written "
                                       f"{expected:08x})")
