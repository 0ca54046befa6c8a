"""The shards of a manifest as columns, and the binary index (`shardkit.index`) that stores them.

A manifest of a million shards is ~250 MB of JSON: `json.loads` builds a million dicts (~1.3 GB,
~20 s here) before a single check runs. The build therefore writes, beside the JSON, a binary index
of the same manifest: the JSON's top-level fields (everything but `shards`) and one array per
shard field. A reader maps the arrays with `np.frombuffer` (no per-shard object), validates them a
column at a time, and creates a `ShardInfo` only for a shard it actually touches. The JSON stays the
source of truth: the index records the JSON's size and SHA-256, and a reader uses the index only
when the JSON it has matches them (see `shardkit.manifest.load_manifest`).

The node cache's private copy of the index is memory-mapped (`map_index_file`) rather than read: the
columns are then the file's pages in the page cache, one copy shared by every process of the node,
and each process touches only the pages it uses (a rank reads the counts up front, a shard's name and
SHA-256 when it reads that shard), instead of holding ~100 MB of private memory at a million shards.

Layout (little-endian; docs/FORMAT.md section "Binary index"):
`SKINDEX1` | u64 header length | header (UTF-8 JSON) | zero padding to 8 bytes |
samples, tokens, compressed_bytes, raw_bytes: i64[N] each | name offsets i64[N+1] |
sha256 u8[N, 32] | has_doc_boundaries u8[N] | [only when the header's "index" entry says
"block_index": true (format version 2 shards): zero padding to 8 bytes | index_offset, index_bytes:
i64[N] each, -1 for a shard without a block index | index_sha256 u8[N, 32]] | names (UTF-8,
concatenated) | SHA-256 of every byte before it (32 bytes).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO

import numpy as np

from shardkit.errors import ManifestError
from shardkit.hashing import read_pieces, sha256_pieces
from shardkit.names import check_relative_name
from shardkit.shard_info import ShardInfo

INDEX_NAME = "shardkit.index"
INDEX_MAGIC = b"SKINDEX1"
COUNT_FIELDS = ("samples", "tokens", "compressed_bytes", "raw_bytes")
# Any of these inside a name marks it unsafe (see names.py): a NUL, an empty, '.' or '..' component,
# a backslash, a URL scheme. The ends of names (leading '/', "./", drive letters...) are checked apart.
_UNSAFE_PARTS = (b"\x00", b"//", b"/./", b"/../", b"\\", b"://")
_HASH_CHUNK = 1 << 17  # names hashed or compared this many at a time (bounds the temporary arrays)
_SCAN_BYTES = 1 << 20  # bytes of names searched at a time for unsafe parts (bounds the copy searched)
MAX_NAME_BYTES = 1024  # S3's limit for a whole key; also bounds the name-hashing loop


class ShardColumns(Sequence):
    """The shards of a manifest, one numpy array per field; `ShardInfo` objects made on access.

    Built by `from_shards` (a list of `ShardInfo`), `decode_index` or `map_index_file`; compares equal to
    the tuple of the same shards, so a manifest read through the index equals the one the build wrote.
    `names` is the shards' names concatenated: bytes, or a read-only view of the index that holds them.
    """

    def __init__(self, *, names: bytes | memoryview, name_offsets: np.ndarray, sha256: np.ndarray,
                 has_doc_boundaries: np.ndarray, block_index: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
                 **counts: np.ndarray):
        self.names = names
        self.name_offsets = name_offsets
        self.sha256 = sha256
        self.has_doc_boundaries = has_doc_boundaries
        self.samples, self.tokens = counts["samples"], counts["tokens"]
        self.compressed_bytes, self.raw_bytes = counts["compressed_bytes"], counts["raw_bytes"]
        # Format version 2: (index_offset, index_bytes, index_sha256) per shard, offsets -1 where a
        # shard has none (an empty shard); None when no shard has one (version 1).
        self.block_index = block_index

    @property
    def has_block_index(self) -> np.ndarray:
        if self.block_index is None:
            return np.zeros(len(self), dtype=bool)
        return self.block_index[0] >= 0

    @classmethod
    def from_shards(cls, shards: Sequence[ShardInfo]) -> ShardColumns:
        encoded = [s.name.encode() for s in shards]
        offsets = np.zeros(len(shards) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=offsets[1:])
        counts = {f: np.fromiter((getattr(s, f) for s in shards), dtype=np.int64, count=len(shards))
                  for f in COUNT_FIELDS}
        sha = np.frombuffer(b"".join(bytes.fromhex(s.sha256) for s in shards), dtype=np.uint8).reshape(-1, 32)
        docs = np.fromiter((s.has_doc_boundaries for s in shards), dtype=bool, count=len(shards))
        block_index = None
        if any(s.index_sha256 is not None for s in shards):
            block_index = (
                np.fromiter((-1 if s.index_offset is None else s.index_offset for s in shards), np.int64, len(shards)),
                np.fromiter((-1 if s.index_bytes is None else s.index_bytes for s in shards), np.int64, len(shards)),
                np.frombuffer(b"".join(bytes.fromhex(s.index_sha256 or "0" * 64) for s in shards),
                              dtype=np.uint8).reshape(-1, 32))
        return cls(names=b"".join(encoded), name_offsets=offsets, sha256=sha, has_doc_boundaries=docs,
                   block_index=block_index, **counts)

    def __len__(self) -> int:
        return len(self.samples)

    def name(self, index: int) -> str:
        return str(self.names[self.name_offsets[index]:self.name_offsets[index + 1]], "utf-8")

    def find(self, name: str) -> int | None:
        """Index of the shard called `name`, or None. Only names of its length are compared (8 bytes
        at a time, no per-shard strings), so a name no shard's length matches reads no name at all."""
        target = name.encode()
        words, wanted = _NameWords(self.names), _NameWords(target)
        whole = (np.zeros(1, dtype=np.int64), np.array([len(target)], dtype=np.int64))
        for first in range(0, len(self), _HASH_CHUNK):
            offsets = self.name_offsets[first:first + _HASH_CHUNK + 1]
            starts, lengths = offsets[:-1], np.diff(offsets)
            same = np.flatnonzero(lengths == len(target))
            for k in range(0, len(target), 8):
                same = same[words.at(starts[same], lengths[same], k) == wanted.at(*whole, k)]
            if same.size:
                return first + int(same[0])
        return None

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        i = range(len(self))[index]
        block = {}
        if self.block_index is not None and self.block_index[0][i] >= 0:
            offsets, sizes, digests = self.block_index
            block = {"index_offset": int(offsets[i]), "index_bytes": int(sizes[i]),
                     "index_sha256": digests[i].tobytes().hex()}
        return ShardInfo(name=self.name(i), samples=int(self.samples[i]), tokens=int(self.tokens[i]),
                         compressed_bytes=int(self.compressed_bytes[i]), raw_bytes=int(self.raw_bytes[i]),
                         sha256=self.sha256[i].tobytes().hex(), has_doc_boundaries=bool(self.has_doc_boundaries[i]),
                         **block)

    def __iter__(self) -> Iterator[ShardInfo]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ShardColumns):
            return (len(self) == len(other) and self.names == other.names
                    and all(np.array_equal(getattr(self, f), getattr(other, f))
                            for f in ("name_offsets", "sha256", "has_doc_boundaries", *COUNT_FIELDS))
                    and (self.block_index is None) == (other.block_index is None)
                    and (self.block_index is None
                         or all(np.array_equal(a, b) for a, b in zip(self.block_index, other.block_index))))
        if isinstance(other, (tuple, list)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # mutable arrays inside: like a list, not hashable

    def __getstate__(self) -> dict[str, Any]:
        # A view of a mapped index cannot be pickled: another process gets the names as bytes (and the
        # arrays, as numpy pickles them, as copies).
        return dict(self.__dict__, names=bytes(self.names))

    def __repr__(self) -> str:
        return f"ShardColumns({len(self)} shards)"

    def check(self, *, source: str) -> None:
        """Column-at-a-time checks of what `ShardInfo.__post_init__` checks one shard at a time,
        plus unique names. Raises `ManifestError` naming `source` and the first bad shard."""
        for field in COUNT_FIELDS:
            bad = np.flatnonzero(getattr(self, field) < 0)
            if bad.size:
                raise ManifestError(f"{source}: shard {self.name(int(bad[0]))}: {field} must be a non-negative "
                                    f"integer, got {int(getattr(self, field)[bad[0]])}")
        if self.block_index is not None:
            offsets, sizes = self.block_index[:2]
            bad = np.flatnonzero((offsets < -1) | (sizes < -1) | ((offsets < 0) != (sizes < 0)))
            if bad.size:
                raise ManifestError(f"{source}: shard {self.name(int(bad[0]))}: index_offset and index_bytes must "
                                    "both be non-negative, or both absent")
        try:
            names = np.frombuffer(self.names, dtype=np.uint8)
            if names.size and names.max() >= 0x80:  # ASCII (every name a build writes) is UTF-8: no 25 MB str
                str(self.names, "utf-8")
        except UnicodeDecodeError as err:
            raise ManifestError(f"{source}: a shard name is not valid UTF-8 ({err})") from None
        self._check_names(source)
        self._check_unique(source)

    def _check_names(self, source: str) -> None:
        lengths = np.diff(self.name_offsets)
        bad = np.flatnonzero(lengths == 0)
        if bad.size:
            raise ManifestError(f"{source}: shard {int(bad[0])} has an empty name")
        bad = np.flatnonzero(lengths > MAX_NAME_BYTES)
        if bad.size:
            raise ManifestError(f"{source}: shard {int(bad[0])}'s name is longer than {MAX_NAME_BYTES} bytes")
        # C-speed substring searches over the concatenated names (a bytes copy of a window at a time:
        # the names may be a view of a mapped file) instead of a Python call per name. A hit is checked
        # exactly on the names it touches (one that spans two names, "a" + "//b", is judged by those
        # names), then the first and last bytes of every name are checked at once.
        longest = max(len(part) for part in _UNSAFE_PARTS)
        for lo in range(0, len(self.names), _SCAN_BYTES):
            window = bytes(self.names[lo:lo + _SCAN_BYTES + longest - 1])  # parts that start in this chunk
            for part in _UNSAFE_PARTS:
                at = window.find(part)
                while 0 <= at < _SCAN_BYTES:
                    first = int(np.searchsorted(self.name_offsets, lo + at, side="right")) - 1
                    last = int(np.searchsorted(self.name_offsets, lo + at + len(part) - 1, side="right")) - 1
                    for index in range(first, last + 1):
                        self._check_one(index, source)
                    at = window.find(part, at + 1)
        data = np.frombuffer(self.names, dtype=np.uint8)
        for lo in range(0, len(self), _HASH_CHUNK):  # a chunk of names at a time: small temporaries
            bad = _bad_ends(data, self.name_offsets[lo:lo + _HASH_CHUNK + 1])
            for index in np.flatnonzero(bad)[:1].tolist():
                self._check_one(lo + index, source)

    def _names_increase(self, words: _NameWords) -> bool:
        """Whether every name is greater, byte by byte, than the one before it."""
        for first in range(0, len(self) - 1, _HASH_CHUNK):
            offsets = self.name_offsets[first:first + _HASH_CHUNK + 2]  # one name more: the last pair
            starts, lengths = offsets[:-1], np.diff(offsets)
            tied = np.ones(len(starts) - 1, dtype=bool)  # pairs whose bytes so far are equal
            for k in range(0, int(lengths.max()), 8):
                word = words.at(starts, lengths, k).byteswap()  # big-endian: compares as the bytes do
                if np.any(tied & (word[:-1] > word[1:])):
                    return False
                tied &= word[:-1] == word[1:]
                if not tied.any():
                    break
            if tied.any():  # equal names (NUL, the padding, is refused in names before this runs)
                return False
        return True

    def _check_one(self, index: int, source: str) -> None:
        name = str(self.names[self.name_offsets[index]:self.name_offsets[index + 1]], "utf-8", errors="replace")
        try:
            check_relative_name(name, what="shard name")
        except ValueError as err:
            raise ManifestError(f"{source}: {err}") from None

    def _check_unique(self, source: str) -> None:
        # Names in increasing byte order (a build numbers its shards in order) are all different:
        # checked pairwise, 8 bytes at a time, without sorting. Otherwise a 64-bit hash per name, then
        # exact comparison of the names whose hashes collide: no million Python strings, no set of them.
        words = _NameWords(self.names)
        if self._names_increase(words):
            return
        hashes = np.empty(len(self), dtype=np.uint64)
        with np.errstate(over="ignore"):
            for first in range(0, len(self), _HASH_CHUNK):
                offsets = self.name_offsets[first:first + _HASH_CHUNK + 1]
                starts, lengths = offsets[:-1], np.diff(offsets)
                h = lengths.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
                for k in range(0, int(lengths.max(initial=0)), 8):
                    h = (h ^ words.at(starts, lengths, k)) * np.uint64(0x100000001B3)
                h ^= h >> np.uint64(33)  # finalizer: every input bit reaches every output bit
                h *= np.uint64(0xFF51AFD7ED558CCD)
                h ^= h >> np.uint64(33)
                hashes[first:first + len(starts)] = h
        ordered = np.sort(hashes)
        if not np.any(ordered[1:] == ordered[:-1]):
            return  # the usual case: no two hashes equal, so no two names equal
        order = np.argsort(hashes, kind="stable")
        same = np.flatnonzero(hashes[order][1:] == hashes[order][:-1])
        seen: dict[str, int] = {}
        for i in np.unique(np.concatenate([order[same], order[same + 1]])).tolist():
            name = self.name(i)
            if name in seen:
                raise ManifestError(f"{source}: manifest names the same shard twice ({name!r}, shards "
                                    f"{seen[name]} and {i})")
            seen[name] = i


def _bad_ends(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per name (between consecutive `offsets` into `data`), whether its first or last bytes make it
    unsafe: absolute, ".", "..", "./" or "../" first, "/", "/." or "/.." last, or a drive letter."""
    start, end, last = offsets[:-1], offsets[1:], max(len(data) - 1, 0)
    lengths = end - start

    def first(k: int) -> np.ndarray:  # byte k of each name, 0 past its end
        return np.where(lengths > k, data[np.minimum(start + k, last)], 0)

    def final(k: int) -> np.ndarray:  # byte k from the end of each name (k >= 1), 0 before its start
        return np.where(lengths >= k, data[np.maximum(end - k, 0)], 0)

    b0, b1, b2 = first(0), first(1), first(2)
    z1, z2, z3 = final(1), final(2), final(3)
    dot, slash = ord("."), ord("/")
    letter = ((b0 | 0x20) >= ord("a")) & ((b0 | 0x20) <= ord("z"))
    return ((b0 == slash) | (z1 == slash)                                    # absolute, or an empty last part
            | ((b0 == dot) & ((b1 == slash) | (lengths == 1)))               # "./..." or "."
            | ((b0 == dot) & (b1 == dot) & ((b2 == slash) | (lengths == 2)))  # "../..." or ".."
            | ((z1 == dot) & (z2 == slash))                                  # ".../."
            | ((z1 == dot) & (z2 == dot) & (z3 == slash))                    # ".../.."
            | (letter & (b1 == ord(":"))))                                   # a drive letter


class _NameWords:
    """Bytes k..k+7 of many names at once, as little-endian uint64 (0 past a name's end)."""

    def __init__(self, names: bytes | memoryview):
        if len(names) < 8:  # too short for one 8-byte window: pad a copy (at most 7 bytes)
            names = bytes(names) + bytes(8)
        self.size = len(names)
        # A uint64 view starting at every byte (`size - 7` of them): no copy.
        self.windows = np.ndarray(shape=(self.size - 7,), dtype="<u8", buffer=names, strides=(1,))

    def at(self, starts: np.ndarray, lengths: np.ndarray, k: int) -> np.ndarray:
        # Near the end of the buffer, the last 8 bytes shifted down.
        at = np.minimum(starts + k, self.size - 8)
        word = self.windows[at] >> (np.uint64(8) * (starts + k - at).astype(np.uint64))
        keep = np.clip(lengths - k, 0, 8).astype(np.uint64)  # bytes of each name in its word
        return word & np.where(keep == 8, ~np.uint64(0), (np.uint64(1) << (np.uint64(8) * keep)) - np.uint64(1))


def encode_index(header: dict[str, Any], shards: ShardColumns, *, json_bytes: bytes) -> bytes:
    """The binary index of a manifest whose JSON is `json_bytes` (`header` = its fields but `shards`)."""
    head = dict(header, index={"json_bytes": len(json_bytes), "json_sha256": hashlib.sha256(json_bytes).hexdigest(),
                               "shards": len(shards), "block_index": shards.block_index is not None})
    head_bytes = json.dumps(head, sort_keys=True).encode()
    parts = [INDEX_MAGIC, np.uint64(len(head_bytes)).tobytes(), head_bytes, b"\0" * (-len(head_bytes) % 8)]
    parts += [np.ascontiguousarray(getattr(shards, f), dtype="<i8").tobytes() for f in COUNT_FIELDS]
    parts += [np.ascontiguousarray(shards.name_offsets, dtype="<i8").tobytes(),
              np.ascontiguousarray(shards.sha256, dtype=np.uint8).tobytes(),
              np.ascontiguousarray(shards.has_doc_boundaries, dtype=np.uint8).tobytes()]
    if shards.block_index is not None:
        offsets, sizes, digests = shards.block_index
        parts += [b"\0" * (-len(shards) % 8), np.ascontiguousarray(offsets, dtype="<i8").tobytes(),
                  np.ascontiguousarray(sizes, dtype="<i8").tobytes(), np.ascontiguousarray(digests, np.uint8).tobytes()]
    parts.append(shards.names)
    body = b"".join(parts)
    return body + hashlib.sha256(body).digest()


def decode_index(data: bytes, *, source: str) -> tuple[dict[str, Any], ShardColumns]:
    """(header, shards) of an index held whole in `data` (the columns and names view it: no copy);
    the header's "index" entry holds the JSON's size and SHA-256.

    Raises:
        ManifestError: the bytes are not a complete, self-consistent index (naming `source`).
    """
    view = memoryview(data)
    header, names_start = _index_header(view, source=source)
    if names_start > len(view) - 32:
        raise ManifestError(f"{source}: index too short for its shards")
    if hashlib.sha256(view[:-32]).digest() != view[-32:]:
        raise ManifestError(f"{source}: index checksum mismatch (truncated or damaged)")
    return header, _columns(view, header, names_start, source=source)


def map_index_file(fh: BinaryIO, *, source: str, checked_stamp: str | None = None
                   ) -> tuple[dict[str, Any], ShardColumns, str]:
    """(header, shards, stamp) of an open local index file, memory-mapped (module docstring).

    Only for a file that is never rewritten in place, such as the node cache's private copy, which is
    replaced by rename only: a mapping keeps the file it was made from (a rename gives the new file a
    new inode), but bytes written into that very file would change columns already checked, and
    truncating it would kill the reader (SIGBUS). The checksum is computed by reading the file, not
    through the mapping, so checking it adds no resident pages; it is skipped when `checked_stamp` is
    this file's `file_stamp` (the node's first process verified this very file).

    Raises:
        ManifestError: the file is not a complete, self-consistent index (naming `source`).
    """
    st = os.fstat(fh.fileno())
    stamp = file_stamp(st)
    if st.st_size < 16:  # also what mmap refuses: an empty file
        raise ManifestError(f"{source}: not a shardkit index")
    view = memoryview(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))
    header, names_start = _index_header(view, source=source)
    if names_start > len(view) - 32:
        raise ManifestError(f"{source}: index too short for its shards")
    if stamp != checked_stamp:
        fh.seek(0)
        if sha256_pieces(read_pieces(fh, len(view) - 32))[1].digest() != view[-32:]:
            raise ManifestError(f"{source}: index checksum mismatch (truncated or damaged)")
    return header, _columns(view, header, names_start, source=source), stamp


def file_stamp(st: os.stat_result) -> str:
    """What identifies one version of a local file: size, modification time and inode."""
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


def _index_header(data: bytes | memoryview, *, source: str) -> tuple[dict[str, Any], int]:
    """(header, offset of the names) from the first bytes of an index (magic, length, header)."""
    if len(data) < 16 or data[:8] != INDEX_MAGIC:
        raise ManifestError(f"{source}: not a shardkit index")
    head_len = int(np.frombuffer(data, dtype="<u8", count=1, offset=8)[0])
    if head_len > len(data) - 16:
        raise ManifestError(f"{source}: index too short for its header")
    try:
        header = json.loads(bytes(memoryview(data)[16:16 + head_len]))
        n = int(header["index"]["shards"])
        blocks = header["index"].get("block_index", False) is True
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        raise ManifestError(f"{source}: malformed index header ({type(err).__name__}: {err})") from None
    if n < 0:
        raise ManifestError(f"{source}: index too short for {n} shards")
    names_start = 16 + head_len + (-head_len % 8) + 8 * (4 * n + n + 1) + 33 * n
    if blocks:
        names_start += -n % 8 + 16 * n + 32 * n
    return header, names_start


def _columns(view: memoryview, header: dict[str, Any], names_start: int, *, source: str) -> ShardColumns:
    """The shards of a whole index (`view`, its checksum already checked): arrays that view it."""
    n = int(header["index"]["shards"])
    head_len = int(np.frombuffer(view, dtype="<u8", count=1, offset=8)[0])
    offset = 16 + head_len + (-head_len % 8)

    def take(dtype: str, count: int) -> np.ndarray:
        nonlocal offset
        array = np.frombuffer(view, dtype=dtype, count=count, offset=offset)
        offset += array.nbytes
        return array

    counts = {f: take("<i8", n) for f in COUNT_FIELDS}
    name_offsets, sha = take("<i8", n + 1), take("u1", 32 * n).reshape(n, 32)
    docs = take("u1", n)
    block_index = None
    if header["index"].get("block_index", False) is True:
        offset += -n % 8
        block_index = (take("<i8", n), take("<i8", n), take("u1", 32 * n).reshape(n, 32))
    names = view[names_start:len(view) - 32]
    if name_offsets[0] != 0 or name_offsets[-1] != len(names) or np.any(name_offsets[1:] < name_offsets[:-1]):
        raise ManifestError(f"{source}: index name offsets are inconsistent")
    if np.any(docs > 1):
        raise ManifestError(f"{source}: index has_doc_boundaries values must be 0 or 1")
    return ShardColumns(names=names, name_offsets=name_offsets, sha256=sha, has_doc_boundaries=docs.view(bool),
                        block_index=block_index, **counts)
