"""The decoded-shard file: a shard decompressed once into the local cache and read through mmap.

Layout (little-endian):

    b"SKDECODE"               8-byte magic
    header length             uint64
    header                    UTF-8 JSON: {"version": 1, "arrays": {name: {"dtype", "offset", "count"}}}
    arrays                    each starting at a 64-byte-aligned offset

Opening maps the file once and returns `ShardArrays` whose arrays are zero-copy numpy views of the
mapping: reading a sample is pointer arithmetic, with no per-sample decode. The file is written to a
temporary name and renamed, so a reader never maps a partial file.
"""

from __future__ import annotations

import json
import os
import struct
import uuid

import numpy as np

from shardkit.errors import CorruptShardError
from shardkit.formats.sample import ShardArrays

MAGIC = b"SKDECODE"
VERSION = 1
ALIGN = 64
_ARRAY_NAMES = ("tokens", "sample_offsets", "doc_offsets", "doc_starts", "doc_source", "doc_index")
_ALLOWED_DTYPES = {"<u2", "<u4", "<i4", "<i8"}


def write_decoded(path: str, arrays: ShardArrays) -> int:
    """Write `arrays` to `path` atomically (tmp file + rename); returns the file size."""
    present = [(n, getattr(arrays, n)) for n in _ARRAY_NAMES if getattr(arrays, n) is not None]
    # Offsets depend on the header length, which depends on the offsets: fix the header size first
    # by formatting offsets as zero-padded 20-digit numbers.
    entries, cursor = {}, 0
    for name, array in present:
        entries[name] = {"dtype": array.dtype.str, "offset": cursor, "count": int(array.size)}
        cursor += -(-array.nbytes // ALIGN) * ALIGN
    probe = json.dumps({"version": VERSION, "arrays": {n: {**e, "offset": 10**19} for n, e in entries.items()}})
    data_start = -(-(len(MAGIC) + 8 + len(probe)) // ALIGN) * ALIGN
    for entry in entries.values():
        entry["offset"] += data_start
    header = json.dumps({"version": VERSION, "arrays": entries}).encode()
    header = header + b" " * (data_start - len(MAGIC) - 8 - len(header))
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(MAGIC + struct.pack("<Q", len(header)) + header)
            for name, array in present:
                fh.seek(entries[name]["offset"])
                fh.write(np.ascontiguousarray(array).tobytes())
            fh.truncate(max(fh.tell(), data_start + cursor))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return os.path.getsize(path)


def open_decoded(path: str, *, shard: str | None = None) -> ShardArrays:
    """Map a decoded-shard file; returns zero-copy views. Raises `CorruptShardError` if malformed."""
    label = shard or path
    size = os.path.getsize(path)
    if size < len(MAGIC) + 8:
        raise CorruptShardError(label, f"decoded cache file {path} is truncated")
    # Plain ndarray views of the np.memmap (which they keep alive through .base): the memmap subclass
    # adds ~1 us of Python overhead to every slice and fancy index, a third of a batch gather.
    mapped = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
    if bytes(mapped[:8]) != MAGIC:
        raise CorruptShardError(label, f"{path} is not a shardkit decoded-shard file")
    (header_len,) = struct.unpack("<Q", bytes(mapped[8:16]))
    if 16 + header_len > size:
        raise CorruptShardError(label, f"decoded cache file {path} has a truncated header")
    try:
        header = json.loads(bytes(mapped[16:16 + header_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptShardError(label, f"decoded cache file {path} has an unreadable header") from err
    if not isinstance(header, dict) or header.get("version") != VERSION or not isinstance(header.get("arrays"), dict):
        raise CorruptShardError(label, f"decoded cache file {path}: unsupported header (version {header.get('version') if isinstance(header, dict) else '?'})")
    entries = header["arrays"]
    views: dict[str, np.ndarray | None] = dict.fromkeys(_ARRAY_NAMES)
    for name, entry in entries.items():
        dtype, offset, count = entry.get("dtype"), entry.get("offset"), entry.get("count")
        if name not in views or dtype not in _ALLOWED_DTYPES or not isinstance(offset, int) or not isinstance(count, int):
            raise CorruptShardError(label, f"decoded cache file {path}: bad array entry {name!r}")
        nbytes = count * np.dtype(dtype).itemsize
        if offset < 16 + header_len or offset + nbytes > size or count < 0:
            raise CorruptShardError(label, f"decoded cache file {path}: array {name} lies outside the file")
        views[name] = mapped[offset:offset + nbytes].view(dtype)
    if views["tokens"] is None or views["sample_offsets"] is None:
        raise CorruptShardError(label, f"decoded cache file {path} lacks tokens or offsets")
    arrays = ShardArrays(**views)
    arrays.validate(label)
    return arrays
