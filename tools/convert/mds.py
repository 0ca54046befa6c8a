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
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
from dataclasses import dataclass

import numpy as np

from shardkit.storage import open_filesystem, redact_url, retry_call
from shardkit.tools.convert.documents import TokenSettings, read_index_json, source_files, token_documents
from shardkit.tools.documents import UnitResult
from shardkit.tools.inputs import InputFile, WorkUnit

VALUE_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 32: "uint32", 33: "int32", 64: "uint64",
                65: "int64"}
_SHAPE_DTYPES = {0: "<u1", 1: "<u2", 2: "<u4", 3: "<u8"}


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
    raw_hashes: dict


def expand_sources(inputs: tuple[str, ...], *, token_field: str, storage_options
                   ) -> list[tuple[InputFile, MDSShard, int]]:
    """(shard file, its description, its samples) of each shard of each SRC (a directory holding
    `index.json`), in index order (`documents.file_units` makes one work unit of each)."""
    found = []
    for spec in inputs:
        fs, path, name, index = read_index_json(spec, storage_options, fields=("shards",), what="MDS")
        stored = [_stored(shard, number, name, token_field) for number, shard in enumerate(index["shards"])]
        files = source_files([(fs, f"{path}/{data['basename']}") for data in stored], "mds")
        found += [_shard(file, shard, token_field) for file, shard in zip(files, index["shards"])]
    return found


def _stored(shard: dict, number: int, index_name: str, token_field: str) -> dict:
    """The index entry of the file that holds the shard (its compressed form when it has one), once the
    shard is one this reader knows."""
    where = f"{index_name}: shard {number}"
    if shard.get("format") != "mds":
        raise ValueError(f"{where}: format {shard.get('format')!r}; only 'mds' shards are read")
    if token_field not in shard["column_names"]:
        raise ValueError(f"{where}: no column {token_field!r} (columns: {', '.join(shard['column_names'])}); "
                         "choose one with --token-field")
    return shard["zip_data"] if shard.get("compression") else shard["raw_data"]


def _shard(file: InputFile, shard: dict, token_field: str) -> tuple[InputFile, MDSShard, int]:
    stored = shard["zip_data"] if shard.get("compression") else shard["raw_data"]
    column = shard["column_names"].index(token_field)
    description = MDSShard(url=file.url, column=column, column_sizes=tuple(shard["column_sizes"]),
                           encoding=shard["column_encodings"][column], samples=int(shard["samples"]),
                           compression=shard.get("compression"), stored_bytes=int(stored["bytes"]),
                           stored_hashes=dict(stored.get("hashes") or {}),
                           raw_hashes=dict((shard.get("raw_data") or {}).get("hashes") or {}))
    return file, description, description.samples


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


def _decompress(algorithm: str, data: bytes) -> bytes:
    family = algorithm.split(":", 1)[0]
    if family == "zstd":
        import zstandard

        return zstandard.ZstdDecompressor().decompressobj().decompress(data)
    if family == "gz":
        return gzip.decompress(data)
    if family == "bz2":
        return bz2.decompress(data)
    raise ValueError(f"compression {algorithm!r} is not supported (zstd, gz, bz2)")


def _shard_problem(shard: MDSShard, stored: bytes) -> tuple[bytes, str | None]:
    """(the decompressed shard, the reason its samples cannot be read or None)."""
    if len(stored) != shard.stored_bytes:
        return b"", f"the shard holds {len(stored)} bytes, index.json says {shard.stored_bytes} (truncated or replaced)"
    problem = _hash_problem(stored, shard.stored_hashes, "stored file")
    if problem:
        return b"", problem
    try:
        raw = _decompress(shard.compression, stored) if shard.compression else stored
    except Exception as err:  # noqa: BLE001 - any codec error means the same: unreadable
        return b"", f"the shard does not decompress ({type(err).__name__}: {err})"
    if shard.compression:
        problem = _hash_problem(raw, shard.raw_hashes, "decompressed")
    return raw, problem


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
