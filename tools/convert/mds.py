"""MosaicML Streaming (MDS) datasets: `index.json` and its shards, one document a sample.

The layout is `mosaicml-streaming`'s (format "mds", version 2), read here from its documented shape so
that any fsspec URL works and streaming itself (whose requirements replace the CPU torch) is not
needed; the tests write sources with streaming's own `MDSWriter`.

- `index.json`: `{"version": 2, "shards": [...]}`; each shard names its `column_names`,
  `column_encodings`, `column_sizes` (null for variable-size columns), `samples`, `compression`
  (null, "zstd[:L]", "gz[:L]" or "bz2[:L]" here) and `raw_data` / `zip_data`: `{"basename", "bytes",
  "hashes": {algorithm: hex}}` (the stored file is `zip_data` when compressed).
- a shard (decompressed): u32 sample count N, u32 offsets[N + 1] (absolute byte offsets of each
  sample), the writer's JSON config, the samples. A sample is a u32 size per variable-size column, then
  each column's bytes in column order.
- the token column's encoding is `ndarray[:DTYPE[:SHAPE]]`: without a DTYPE, one byte of dtype code
  first (8 uint8, 9 int8, 16 uint16, 17 int16, 32 uint32, 33 int32, 64 uint64, 65 int64); without a
  SHAPE, one byte `ndim << 2 | k` and ndim dimensions of 2**k bytes each; then the values.

A work unit is one shard file. Every hash `index.json` lists for it that hashlib (or xxhash, when
installed) computes is checked: a shard failing one has each of its samples rejected, naming the hash.
So is its size: a compressed shard is inflated to at most the raw size `index.json` declares (a small
file that inflates further is refused there, never held whole), it must inflate to exactly that size,
and its last sample must end where its bytes end. `index.json` itself is checked first
(`source_index`): its shape, names that stay inside the dataset, and sample counts its files can hold.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
from dataclasses import dataclass

import numpy as np

from shardkit.storage import open_filesystem, redact_url, retry_call
from shardkit.text.documents import UnitResult
from shardkit.text.inputs import InputFile, WorkUnit

from .documents import TokenSettings, source_files, token_documents
from .source_index import IndexEntry, items_held, read_index_json

VALUE_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 32: "uint32", 33: "int32", 64: "uint64",
                65: "int64"}
_SHAPE_DTYPES = {0: "<u1", 1: "<u2", 2: "<u4", 3: "<u8"}
# The most bytes one stored byte can inflate to, per codec: a zstd RLE block is 4 bytes for at most
# 128 KiB; deflate's longest match is 258 bytes for about 2 bits (1032:1); a bzip2 block's run-length
# stage makes 5 bytes into 259 and measures ~1.2 million : 1 on zeros. A raw size declared beyond this
# cannot be the file's.
MAX_EXPANSION = {"zstd": 1 << 15, "gz": 1032, "bz2": 1 << 21}
_READ_PIECE = 1 << 20


@dataclass(frozen=True)
class MDSShard:
    """One shard as `index.json` describes it (what a worker needs to read and check it)."""

    url: str
    column: int
    column_sizes: tuple[int | None, ...]
    encoding: str
    samples: int
    compression: str | None
    stored_bytes: int
    stored_hashes: dict
    raw_bytes: int
    raw_hashes: dict


def expand_sources(inputs: tuple[str, ...], *, token_field: str, storage_options
                   ) -> list[tuple[InputFile, MDSShard, int]]:
    """(shard file, its description, its samples) of each shard of each SRC (a directory holding
    `index.json`), in index order (`documents.file_units` makes one work unit of each).

    Raises:
        ValueError: `index.json` is not a readable MDS index, names a file outside the dataset, or declares
            more samples than a shard's bytes can hold (one line naming it, the shard and the field).
    """
    found = []
    for spec in inputs:
        fs, path, name, index = read_index_json(spec, storage_options, fields=("shards",), what="an MDS")
        shards = IndexEntry(index, where="", file=name).list("shards")
        described = [_describe(IndexEntry(shard, where=f"shard {number}", file=name), token_field)
                     for number, shard in enumerate(shards)]
        files = source_files([(fs, f"{path}/{basename}") for basename, _ in described], "mds")
        for number, (file, (basename, fields)) in enumerate(zip(files, described)):
            shard = MDSShard(url=file.url, **fields)
            _check_room(shard, file, where=f"{name}: shard {number} ({basename})")
            found.append((file, shard, shard.samples))
    return found


def _describe(entry: IndexEntry, token_field: str) -> tuple[str, dict]:
    """(the stored file's name, the `MDSShard` fields) of one shard entry, once it is a shard this reader
    knows and its entry has the documented shape."""
    if entry.value.get("format") != "mds":
        entry.refuse(f"{entry.prefix}format {entry.value.get('format')!r}; only 'mds' shards are read")
    names, encodings, sizes = (entry.list(key) for key in ("column_names", "column_encodings", "column_sizes"))
    if not len(names) == len(encodings) == len(sizes) or not all(isinstance(n, str) for n in names + encodings) \
            or not all(size is None or (isinstance(size, int) and not isinstance(size, bool) and size >= 0)
                       for size in sizes):
        entry.refuse(f"{entry.prefix}column_names, column_encodings and column_sizes must be lists of one string, "
                     "string and size (an integer >= 0 or null) per column")
    if token_field not in names:
        entry.refuse(f"{entry.prefix}no column {token_field!r} (columns: {', '.join(names)}); "
                     "choose one with --token-field")
    compression = entry.text("compression", optional=True)
    if compression is not None and compression.split(":", 1)[0] not in MAX_EXPANSION:
        entry.refuse(f"{entry.prefix}compression {compression!r} is not read (only {', '.join(MAX_EXPANSION)})")
    raw = entry.entry("raw_data")
    stored = entry.entry("zip_data") if compression else raw
    column = names.index(token_field)
    return stored.file_name("basename"), dict(
        column=column, column_sizes=tuple(sizes), encoding=encodings[column], samples=entry.count("samples"),
        compression=compression, stored_bytes=stored.count("bytes"), stored_hashes=stored.hashes("hashes"),
        raw_bytes=raw.count("bytes"), raw_hashes=raw.hashes("hashes"))


def _check_room(shard: MDSShard, file: InputFile, *, where: str) -> None:
    """Refuse a shard whose declared samples its bytes cannot hold: the per-sample work (a rejection for
    each, when the shard is damaged) is then bounded by the file, not by a number in the index."""
    if shard.compression:
        most = file.size * MAX_EXPANSION[shard.compression.split(":", 1)[0]]
        if shard.raw_bytes > most:
            raise ValueError(f"{where} declares {shard.raw_bytes} decompressed bytes, but its {file.size} bytes of "
                             f"{shard.compression} inflate to at most {most} (the index does not describe this file)")
        nbytes, what = shard.raw_bytes, f"{shard.raw_bytes} decompressed bytes (as declared)"
    else:
        nbytes, what = file.size, f"{file.size} bytes"
    if shard.samples > items_held(nbytes):
        raise ValueError(f"{where} declares {shard.samples} samples, but its {what} hold at most "
                         f"{items_held(nbytes)} (the index does not describe this file)")


def _digest(algorithm: str, data: bytes) -> str | None:
    """The hex digest with hashlib or xxhash; None for an algorithm neither knows."""
    if algorithm in hashlib.algorithms_available and not algorithm.startswith("shake_"):
        return hashlib.new(algorithm, data).hexdigest()
    try:
        import xxhash
    except ImportError:
        return None
    function = getattr(xxhash, f"{algorithm}_hexdigest", None)
    return function(data) if function else None


def _hash_problem(data: bytes, hashes: dict, what: str) -> str | None:
    for algorithm, expected in sorted(hashes.items()):
        actual = _digest(algorithm, data)
        if actual is not None and actual != expected:
            return f"the shard fails its {algorithm} hash in index.json ({what}: corrupt or replaced)"
    return None


def _inflate(algorithm: str, data: bytes, limit: int) -> bytes:
    """The decompressed bytes, read in pieces and never more than `limit` + 1 of them (a bomb stops
    there: the caller sees more than it was told and refuses the shard)."""
    family, source = algorithm.split(":", 1)[0], io.BytesIO(data)
    if family == "zstd":
        import zstandard

        reader = zstandard.ZstdDecompressor().stream_reader(source, read_across_frames=True)
    elif family == "gz":
        reader = gzip.GzipFile(fileobj=source)
    else:  # bz2: expand_sources refuses any other codec
        reader = bz2.BZ2File(source)
    pieces, total = [], 0
    with reader:
        while total <= limit and (piece := reader.read(min(_READ_PIECE, limit + 1 - total))):
            pieces.append(piece)
            total += len(piece)
    return b"".join(pieces)


def _shard_problem(shard: MDSShard, stored: bytes) -> tuple[bytes, str | None]:
    """(the decompressed shard, the reason its samples cannot be read or None).

    Raises:
        ValueError: the shard inflates to bytes that cannot hold the samples `index.json` declares: the index
            does not describe this file, and rejecting each declared sample would cost what it claims.
    """
    if len(stored) != shard.stored_bytes:
        return b"", f"the shard holds {len(stored)} bytes, index.json says {shard.stored_bytes} (truncated or replaced)"
    problem = _hash_problem(stored, shard.stored_hashes, "stored file")
    if problem or not shard.compression:
        return stored, problem
    try:
        raw = _inflate(shard.compression, stored, shard.raw_bytes)
    except Exception as err:  # noqa: BLE001 - any codec error means the same: unreadable
        return b"", f"the shard does not decompress ({type(err).__name__}: {err})"
    if len(raw) > shard.raw_bytes:
        return b"", f"the shard decompresses to more than the {shard.raw_bytes} bytes index.json declares"
    if len(raw) < shard.raw_bytes:
        if shard.samples > items_held(len(raw)):
            raise ValueError(f"{shard.url}: index.json declares {shard.samples} samples, but the shard's {len(raw)} "
                             f"bytes hold at most {items_held(len(raw))} (the index does not describe this file)")
        return b"", f"the shard decompresses to {len(raw)} bytes, index.json declares {shard.raw_bytes}"
    return raw, _hash_problem(raw, shard.raw_hashes, "decompressed")


def _array_bounds(encoding: str, blob: memoryview) -> tuple[np.dtype, int]:
    """(dtype, byte offset of the values) of one ndarray-encoded value."""
    parts = encoding.split(":")
    if parts[0] != "ndarray" or len(parts) > 3:
        raise ValueError(f"the token column's encoding {encoding!r} is not ndarray[:DTYPE[:SHAPE]]")
    at = 0
    if len(parts) >= 2:
        dtype = parts[1]
    else:
        dtype = VALUE_DTYPES.get(blob[0])
        at = 1
    if dtype not in VALUE_DTYPES.values():
        raise ValueError(f"the token column holds {dtype or 'non-integer'} values, not integer ids")
    if len(parts) < 3:
        ndim, width = blob[at] >> 2, 2 ** (blob[at] % 4)
        if ndim != 1:
            raise ValueError(f"the token array has {ndim} dimensions, not 1")
        at += 1 + ndim * width
    return np.dtype(dtype).newbyteorder("<"), at


def read_shard_unit(unit: WorkUnit, settings: TokenSettings) -> UnitResult:
    """The samples of one MDS shard as documents (runs in a worker process or a Ray task)."""
    shard: MDSShard = unit.payload
    fs, path = open_filesystem(shard.url, settings.storage_options)
    stored = retry_call(lambda: fs.cat_file(path), url=redact_url(shard.url), what="read")
    raw, problem = _shard_problem(shard, stored)
    empty = np.zeros(0, dtype=np.int64)
    if problem is None:
        try:
            return token_documents(unit, *_samples(shard, raw), settings)
        except (ValueError, IndexError) as err:
            problem = f"the shard does not parse: {err}"
    return token_documents(unit, empty, empty, empty, settings, rejected=[(i, problem) for i in range(shard.samples)])


def _samples(shard: MDSShard, raw: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    count = int(np.frombuffer(raw, "<u4", 1)[0])
    if count != shard.samples:
        raise ValueError(f"it holds {count} samples, index.json says {shard.samples}")
    offsets = np.frombuffer(raw, "<u4", count + 1, 4).astype(np.int64)
    if np.any(np.diff(offsets) < 0) or offsets[-1] > len(raw):
        raise ValueError("its sample offsets run backwards or past its end")
    if offsets[-1] < len(raw):  # a writer ends the shard with its last sample: these bytes are nobody's
        raise ValueError(f"{len(raw) - int(offsets[-1])} bytes after the last sample")
    view = memoryview(raw)
    variable = [i for i, size in enumerate(shard.column_sizes) if size is None]
    pieces, lengths = [], np.zeros(count, dtype=np.int64)
    for i in range(count):
        sample = view[offsets[i]:offsets[i + 1]]
        sizes = dict(zip(variable, np.frombuffer(sample, "<u4", len(variable)).tolist()))
        at = 4 * len(variable) + sum(sizes.get(c, shard.column_sizes[c]) for c in range(shard.column))
        blob = sample[at:at + sizes.get(shard.column, shard.column_sizes[shard.column])]
        dtype, start = _array_bounds(shard.encoding, blob)
        values = np.frombuffer(blob[start:], dtype)
        pieces.append(values.astype(np.int64) if dtype.kind == "u" and dtype.itemsize == 8 else values)
        lengths[i] = len(values)
    tokens = np.concatenate([p.astype(np.int64) for p in pieces]) if pieces else np.zeros(0, dtype=np.int64)
    return tokens, lengths, np.arange(count, dtype=np.int64)
