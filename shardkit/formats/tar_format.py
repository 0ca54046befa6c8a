"""The `tar` shard format: a plain (uncompressed) POSIX ustar archive whose *members* are zstd frames.

This module holds the members' parser and writer, and the per-sample layout that shards had before the
group layout (`tar_blocks`, one member group per block of samples, what the writer produces by default);
shards of this layout stay readable and `ShardWriter(tar_layout="samples")` still writes them.

Sample i of a shard is two members, WebDataset-style (same key, different extensions):

    {i:09d}.tokens.npy.zst   the token ids, a 1-D .npy array (<u2 or <u4), zstd-compressed
    {i:09d}.docs.npy.zst     only with document boundaries: int64 array of shape (k, 3), one row per
                             document segment: [start within the sample, source id, document index]

Why per-member compression rather than one `.tar.zst`: the archive stays a tar that `tar tf`,
`webdataset` and any tar reader open directly (webdataset only needs a one-line `.zst` decode hook,
`wds_decode_hook` below); every member can be located from the headers and fetched by a byte-range
read without decompressing the rest; and a flipped byte corrupts one sample's frame, which its
zstd checksum detects, not the whole shard. The cost of a member per sample was the ratio: each ~4 KB
sample compressed alone, plus two 512-byte headers per sample, which the group layout removes.

`raw_bytes` for a tar shard is the sum of the decompressed member sizes (the .npy bytes).

The reader is a strict, minimal ustar parser: only regular-file members with the names above are
accepted; links, directories, pax/GNU extension headers, absolute or `..` names, sizes running past
the end of the data and bad header checksums are rejected with `CorruptShardError`. Nothing is ever
extracted to disk and nothing is unpickled (.npy headers are parsed with allow_pickle off).
"""

from __future__ import annotations

import functools
import io
import math
import re
from collections.abc import Iterator

import numpy as np
import numpy.lib.format as npy_format
import zstandard

from shardkit.errors import CorruptShardError
from shardkit.formats.zstd_frames import compressor, decompress_bounded
from shardkit.formats.sample import DOC_INDEX_DTYPE, DOC_SOURCE_DTYPE, DOC_STARTS_DTYPE, OFFSETS_DTYPE, ShardArrays, numpy_token_dtype

BLOCK = 512
RECORD = 20 * BLOCK  # tar's conventional record size; archives are padded to a multiple of it
# Both layouts' member names: this one's, and the group layout's (`tar_blocks`), which shares the parser.
_MEMBER_NAME = re.compile(r"^(\d{9})\.(tokens|docs|sample_offsets|doc_offsets)\.npy\.zst$")
_FIELDS = ("tokens", "docs")
_DOCS_DTYPE = np.dtype("<i8")


@functools.lru_cache(maxsize=1024)
def _npy_header(descr: str, shape: tuple[int, ...]) -> bytes:
    # Samples of a dataset mostly share a shape: format each .npy header once (numpy's writer is
    # pure Python and cost as much as compressing a 4 KB sample).
    buf = io.BytesIO()
    npy_format.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def _npy_bytes(array: np.ndarray) -> bytes:
    """The exact bytes `numpy.save` writes for a C-contiguous array (format 1.0, allow_pickle off)."""
    array = np.ascontiguousarray(array)
    return _npy_header(npy_format.dtype_to_descr(array.dtype), array.shape) + array.tobytes()


_MAX_OCTAL_SIZE = 8**11  # an 11-digit octal size field; larger members would need GNU/pax extensions


def _header(name: str, size: int) -> bytes:
    """A ustar header byte-identical to `tarfile.TarInfo(name).tobuf(USTAR_FORMAT)` with mode 0644, owner
    0:0, mtime 0 (fixed metadata: the same samples always give the same bytes), built directly
    because tarfile's generic writer cost a quarter of the encoding time."""
    encoded = name.encode("utf-8")
    if len(encoded) > 100:
        raise ValueError(f"tar member name {name!r} is longer than 100 bytes")
    if not 0 <= size < _MAX_OCTAL_SIZE:
        raise ValueError(f"tar member {name!r} is {size} bytes, more than a ustar header can describe")
    header = b"".join((
        encoded.ljust(100, b"\0"), b"0000644\0", b"0000000\0", b"0000000\0", b"%011o\0" % size,
        b"00000000000\0", b" " * 8, b"0", b"\0" * 100, b"ustar\x0000", b"\0" * 80,  # uname, gname, devmajor, devminor: empty
    )).ljust(BLOCK, b"\0")
    return header[:148] + b"%06o\0" % sum(header) + header[155:]


class _MemberHeaders:
    """Byte-identical to `_header` for our member names, without building a TarInfo per member.

    Only the name, size and checksum fields differ between members; everything else comes from one
    template made by `tarfile` itself, so the format stays tarfile's.
    """

    def __init__(self) -> None:
        self._template = bytearray(_header("000000000.tokens.npy.zst", 0))
        self._template[148:156] = b" " * 8  # the checksum is computed over spaces in its own field
        self._base_sum = sum(self._template) - sum(self._template[0:100]) - sum(self._template[124:136])

    def __call__(self, name: str, size: int) -> bytes:
        encoded = name.encode("ascii")
        size_field = b"%011o\0" % size
        if len(encoded) > 99 or len(size_field) != 12:
            return _header(name, size)  # never for shard members; kept for safety
        header = self._template.copy()
        header[0:100] = encoded.ljust(100, b"\0")
        header[124:136] = size_field
        checksum = self._base_sum + sum(encoded) + sum(size_field)
        header[148:156] = b"%06o\0 " % checksum
        return bytes(header)


class MemberWriter:
    """Appends `.npy.zst` members to a tar archive being built (both layouts write through it)."""

    def __init__(self, level: int) -> None:
        self.cctx = compressor(level)
        self.headers = _MemberHeaders()
        self.out = bytearray()

    def add(self, key: int, field: str, array: np.ndarray) -> int:
        """Write member `{key:09d}.{field}.npy.zst` holding `array`; returns its raw (.npy) size."""
        payload = _npy_bytes(array)
        frame = self.cctx.compress(payload)
        self.out += self.headers(f"{key:09d}.{field}.npy.zst", len(frame))
        self.out += frame
        self.out += b"\0" * (-len(frame) % BLOCK)
        return len(payload)

    def finish(self) -> bytes:
        """The archive: the members, the end-of-archive blocks, padding to whole records."""
        self.out += b"\0" * (2 * BLOCK)
        self.out += b"\0" * (-len(self.out) % RECORD)
        return bytes(self.out)


def doc_table(arrays: ShardArrays) -> np.ndarray:
    """The shard's document segments as one [segments, 3] int64 table; each sample's rows are a slice."""
    return np.stack([arrays.doc_starts.astype(_DOCS_DTYPE), arrays.doc_source.astype(_DOCS_DTYPE),
                     arrays.doc_index.astype(_DOCS_DTYPE)], axis=1).reshape(-1, 3)


def encode_tar(arrays: ShardArrays, *, level: int) -> tuple[bytes, int]:
    """Serialise a shard in the per-sample layout; returns (file bytes, raw_bytes)."""
    writer = MemberWriter(level)
    raw = 0
    tokens = np.ascontiguousarray(arrays.tokens)
    offsets = arrays.sample_offsets.tolist()
    docs = doc_offsets = None
    if arrays.doc_offsets is not None:
        docs = doc_table(arrays)
        doc_offsets = arrays.doc_offsets.tolist()
    for i in range(arrays.num_samples):
        raw += writer.add(i, "tokens", tokens[offsets[i]:offsets[i + 1]])
        if docs is not None:
            raw += writer.add(i, "docs", docs[doc_offsets[i]:doc_offsets[i + 1]])
    return writer.finish(), raw


def _octal(field: bytes, shard: str, what: str) -> int:
    if field and field[0] & 0x80:
        raise CorruptShardError(shard, f"tar header {what} uses base-256 encoding (absurd size)")
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text, 8) if text else 0
    except ValueError as err:
        raise CorruptShardError(shard, f"tar header {what} is not an octal number: {field!r}") from err


def iter_tar_members(data: bytes | memoryview, shard: str, *, archive_end: bool = True) -> Iterator[tuple[str, memoryview]]:
    """Yield (name, payload view) for each member, validating every header. With `archive_end` false, `data`
    is a run of members (a format v2 block) that ends where the data ends, without the end-of-archive marker."""
    view = memoryview(data)
    pos, end = 0, len(view)
    while True:
        if not archive_end and pos == end:
            return
        if pos + BLOCK > end:
            raise CorruptShardError(shard, f"truncated tar: no end-of-archive marker (stopped at byte {pos})")
        header = bytes(view[pos:pos + BLOCK])
        if header == b"\0" * BLOCK:
            return
        expected = _octal(header[148:156], shard, "checksum")
        actual = sum(header[:148]) + 8 * 32 + sum(header[156:])
        if expected != actual:
            raise CorruptShardError(shard, f"tar header at byte {pos} has a bad checksum (truncated or corrupt)")
        name = header[0:100].split(b"\0", 1)[0]
        prefix = header[345:500].split(b"\0", 1)[0] if header[257:262] == b"ustar" else b""
        full = (prefix + b"/" + name) if prefix else name
        try:
            member = full.decode("utf-8")
        except UnicodeDecodeError as err:
            raise CorruptShardError(shard, f"tar member name {full!r} is not UTF-8") from err
        kind = header[156:157]
        if kind not in (b"0", b"\0"):
            label = {b"1": "a hard link", b"2": "a symbolic link", b"5": "a directory",
                     b"x": "a pax header", b"g": "a pax header", b"L": "a GNU long name"}.get(kind, f"type {kind!r}")
            raise CorruptShardError(shard, f"tar member {member!r} is {label}; only regular files are allowed")
        if not _MEMBER_NAME.match(member):
            raise CorruptShardError(shard, f"unexpected tar member {member!r} (names must look like "
                                           "000000000.tokens.npy.zst; paths, '..' and links are rejected)")
        size = _octal(header[124:136], shard, "size")
        start = pos + BLOCK
        if start + size > end:
            raise CorruptShardError(shard, f"tar member {member!r} claims {size} bytes but the shard ends first (truncated)")
        yield member, view[start:start + size]
        pos = start + size + (-size % BLOCK)


def _parse_npy_header(header: bytes) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran_order, dtype) of a .npy header; numpy's parser never evaluates code."""
    stream = io.BytesIO(header)
    version = npy_format.read_magic(stream)
    if version == (1, 0):
        return npy_format.read_array_header_1_0(stream)
    if version == (2, 0):
        return npy_format.read_array_header_2_0(stream)
    raise ValueError(f"unsupported .npy version {version}")


# Samples of one dataset mostly share a shape, hence a header: parsing it (numpy uses
# ast.literal_eval) once instead of once per member made tar decoding ~3x faster.
_parse_small_npy_header = functools.lru_cache(maxsize=1024)(_parse_npy_header)
_NPY_MAGIC = b"\x93NUMPY"


def _read_npy(payload: bytes, shard: str, member: str) -> np.ndarray:
    try:
        if payload[:6] != _NPY_MAGIC or len(payload) < 12:
            raise ValueError("missing .npy magic")
        # Header length: uint16 after the version bytes in .npy 1.0, uint32 in 2.0.
        start, width = (10, 2) if payload[6] == 1 else (12, 4)
        end = start + int.from_bytes(payload[8:8 + width], "little")
        if end > len(payload):
            raise ValueError("header runs past the end of the member")
        header = bytes(payload[:end])
        parse = _parse_small_npy_header if end <= 256 else _parse_npy_header
        shape, fortran, dtype = parse(header)
    except ValueError as err:
        raise CorruptShardError(shard, f"member {member}: not a valid .npy array ({err})") from err
    if dtype.hasobject or fortran:
        raise CorruptShardError(shard, f"member {member}: object or Fortran-ordered arrays are not allowed")
    count = math.prod(shape)
    if len(payload) - end != count * dtype.itemsize:
        raise CorruptShardError(shard, f"member {member}: .npy payload size does not match its shape {shape}")
    return np.frombuffer(payload, dtype=dtype, count=count, offset=end).reshape(shape)


def decode_tar(data: bytes | memoryview, *, token_dtype: str, shard: str, raw_bytes: int,
               first_sample: int = 0) -> ShardArrays:
    """Parse and decompress a tar shard into flat arrays; `raw_bytes` (from the manifest) bounds it.

    `first_sample` is the key of the first member: a format v2 block of a shard
    (`tar_blocks.decode_tar_block`) starts at its own first sample.
    """
    dtype = numpy_token_dtype(token_dtype)
    # Members are grouped by key, WebDataset-style; keys must run 0, 1, 2, ... without gaps.
    tokens: list[np.ndarray | None] = []
    docs: list[np.ndarray | None] = []
    budget = raw_bytes
    dctx = zstandard.ZstdDecompressor()
    for member, payload in iter_tar_members(data, shard):
        match = _MEMBER_NAME.match(member)
        key, field = int(match.group(1)) - first_sample, match.group(2)
        if field not in _FIELDS:
            raise CorruptShardError(shard, f"member {member}: a group layout member in a per-sample layout shard")
        if key != len(tokens) - 1:
            if key != len(tokens):
                raise CorruptShardError(shard, f"member {member}: expected sample {first_sample + len(tokens):09d} "
                                               "(samples must be in order)")
            tokens.append(None)
            docs.append(None)
        slot = tokens if field == "tokens" else docs
        if slot[-1] is not None:
            raise CorruptShardError(shard, f"member {member} appears twice")
        raw = decompress_bounded(payload, limit=budget, shard=shard, what=f"member {member}", decompressor=dctx)
        budget -= len(raw)
        array = _read_npy(raw, shard, member)
        if field == "tokens" and (array.dtype != dtype or array.ndim != 1):
            raise CorruptShardError(shard, f"member {member}: tokens must be a 1-D {dtype} array, got {array.dtype} {array.shape}")
        if field == "docs" and (array.dtype != _DOCS_DTYPE or array.ndim != 2 or array.shape[1] != 3):
            raise CorruptShardError(shard, f"member {member}: docs must be an int64 (k, 3) array")
        slot[-1] = array
    missing = next((i for i, t in enumerate(tokens) if t is None), None)
    if missing is not None:
        raise CorruptShardError(shard, f"sample {missing:09d} has no tokens member")
    has_docs = any(d is not None for d in docs)
    if has_docs and not all(d is not None for d in docs):
        raise CorruptShardError(shard, "some samples store document boundaries and some do not")
    if budget != 0:
        raise CorruptShardError(shard, f"payload is {raw_bytes - budget} bytes, the manifest says {raw_bytes}")

    lengths = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=len(tokens))
    offsets = np.zeros(len(tokens) + 1, dtype=OFFSETS_DTYPE)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(tokens) if tokens else np.zeros(0, dtype=dtype)
    if not has_docs:
        return arrays_from_parts(flat, offsets, None, None, shard)
    counts = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    doc_offsets = np.zeros(len(docs) + 1, dtype=OFFSETS_DTYPE)
    np.cumsum(counts, out=doc_offsets[1:])
    table = np.concatenate(docs) if docs else np.zeros((0, 3), dtype=_DOCS_DTYPE)
    return arrays_from_parts(flat, offsets, doc_offsets, table, shard)


def arrays_from_parts(tokens: np.ndarray, offsets: np.ndarray, doc_offsets: np.ndarray | None,
                      table: np.ndarray | None, shard: str) -> ShardArrays:
    """Checked `ShardArrays` from a tar shard's decoded tokens, offsets and (k, 3) int64 document table."""
    if table is None:
        arrays = ShardArrays(tokens, offsets)
    else:
        if table.size and (table[:, 0].max() > np.iinfo(DOC_STARTS_DTYPE).max or table[:, 1].min() < -1
                           or table[:, 1].max() > np.iinfo(DOC_SOURCE_DTYPE).max):
            raise CorruptShardError(shard, "document boundary values out of range")
        arrays = ShardArrays(tokens, offsets, doc_offsets, table[:, 0].astype(DOC_STARTS_DTYPE),
                             table[:, 1].astype(DOC_SOURCE_DTYPE), table[:, 2].astype(DOC_INDEX_DTYPE))
    arrays.validate(shard)
    return arrays


def sample_raw_bytes(arrays: ShardArrays) -> np.ndarray:
    """Each sample's share of `raw_bytes`: the sizes of its decompressed .npy members."""
    itemsize = arrays.tokens.dtype.itemsize
    descr = npy_format.dtype_to_descr(arrays.tokens.dtype)
    lengths = np.diff(arrays.sample_offsets)
    raw = np.array([len(_npy_header(descr, (int(n),))) for n in lengths.tolist()], dtype=np.int64) + lengths * itemsize
    if arrays.doc_offsets is not None:
        counts = np.diff(arrays.doc_offsets)
        raw += np.array([len(_npy_header("<i8", (int(k), 3))) for k in counts.tolist()], dtype=np.int64) + counts * 24
    return raw


def sample_member_starts(data: bytes, num_samples: int) -> list[int]:
    """Byte offset of each sample's first member header, plus where the end-of-archive marker starts
    (the writer's side of format v2: blocks are cut at these offsets). `data` is a shard just encoded."""
    starts, pos = [], 0
    while data[pos:pos + BLOCK] != b"\0" * BLOCK:
        size = int(data[pos + 124:pos + 135], 8)
        if int(data[pos:pos + 9]) == len(starts):
            starts.append(pos)
        pos += BLOCK + size + (-size % BLOCK)
    if len(starts) != num_samples:
        raise ValueError(f"found {len(starts)} samples in the encoded tar shard, expected {num_samples}")
    return [*starts, pos]


def wds_decode_hook(key: str, data: bytes):
    """WebDataset decode hook for shardkit tar shards: `WebDataset(url).decode(wds_decode_hook)`.

    It strips the `.zst` layer and lets webdataset's own `.npy` decoder (no pickle) do the rest,
    like webdataset's built-in `.gz` handling.
    """
    if not key.endswith(".zst"):
        return None
    import webdataset.autodecode as autodecode
    import zstandard

    return autodecode.Continue(key[:-4], zstandard.ZstdDecompressor().decompress(data))
