"""The `arrow` shard format: an Arrow IPC *file* (random-access footer) with zstd buffer compression.

Schema (one row per sample; the doc columns exist only when document boundaries are stored):

    tokens      list<uint16> or list<uint32>   the token ids
    doc_starts  list<int32>                    segment starts within the sample (first is 0)
    doc_source  list<int32>                    index into the manifest's `sources` (-1 = padding)
    doc_index   list<int64>                    document index within that source

Record batches hold about `BATCH_RAW_BYTES` of uncompressed data each, so reading one sample
decompresses ~1 MiB, not the whole shard. `raw_bytes` for an arrow shard is, summed over batches
and columns, 4 bytes per row (the list offsets) plus the bytes of the column's values
(`batch_raw_bytes`; pyarrow's `RecordBatch.nbytes` gives the same figure today, but the definition
is ours so that it cannot move with pyarrow versions). Any Arrow reader opens it:
`pyarrow.ipc.open_file(path)`.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from shardkit.errors import CorruptShardError
from shardkit.formats.arrow_ipc import declared_batch_bytes
from shardkit.formats.sample import DOC_INDEX_DTYPE, DOC_SOURCE_DTYPE, DOC_STARTS_DTYPE, OFFSETS_DTYPE, ShardArrays, numpy_token_dtype

BATCH_RAW_BYTES = 1 << 20
# Declared buffer sizes may exceed RecordBatch.nbytes by a little (offsets buffers, alignment).
_SLACK_PER_BUFFER = 64
# Room an encoded shard may take beyond its raw bytes (+1/64): the schema and footer, and per record batch its
# metadata and each compressed buffer's length prefix and padding.
_FILE_SLACK = 1 << 16
_BATCH_SLACK = 1 << 10
_FILE_MAGIC_BYTES = 8  # "ARROW1" and padding, then the IPC stream the footer indexes
_ARROW_TOKEN_TYPES = {"uint16": pa.uint16(), "uint32": pa.uint32()}
_DOC_FIELDS = (("doc_starts", pa.int32()), ("doc_source", pa.int32()), ("doc_index", pa.int64()))


def arrow_schema(token_dtype: str, has_doc_boundaries: bool) -> pa.Schema:
    fields = [pa.field("tokens", pa.list_(_ARROW_TOKEN_TYPES[token_dtype]), nullable=False)]
    if has_doc_boundaries:
        fields += [pa.field(name, pa.list_(kind), nullable=False) for name, kind in _DOC_FIELDS]
    return pa.schema(fields, metadata={"shardkit.format_version": "1"})


def _list_array(offsets: np.ndarray, values: np.ndarray, dtype: np.dtype) -> pa.ListArray:
    # Built from the numpy buffers directly: the same arrays as `pa.array`, without its conversion path,
    # which imports pandas on first use (~0.7 s of a writer's start-up).
    offsets = np.ascontiguousarray(offsets, dtype=np.int32)
    values = np.ascontiguousarray(values, dtype=dtype)
    value_type = pa.from_numpy_dtype(values.dtype)
    child = pa.Array.from_buffers(value_type, len(values), [None, pa.py_buffer(values)])
    return pa.ListArray.from_buffers(pa.list_(value_type), len(offsets) - 1, [None, pa.py_buffer(offsets)],
                                     children=[child])


def batch_raw_bytes(batch: pa.RecordBatch) -> int:
    """4 bytes per row per column plus the column's value bytes (the manifest's `raw_bytes` unit)."""
    total = 0
    for column in batch.columns:
        offsets = column.offsets
        values = offsets[len(column)].as_py() - offsets[0].as_py() if len(column) else 0
        total += 4 * len(column) + values * column.type.value_type.byte_width
    return total


def samples_per_batch(arrays: ShardArrays, batch_bytes: int = BATCH_RAW_BYTES) -> int:
    if arrays.num_samples == 0:
        return 1
    per_sample = max(1, arrays.raw_nbytes // arrays.num_samples)
    return max(1, batch_bytes // per_sample)


def encode_arrow(arrays: ShardArrays, *, token_dtype: str, level: int,
                 batch_bytes: int = BATCH_RAW_BYTES) -> tuple[memoryview, int]:
    """Serialise a shard; returns (file bytes, raw_bytes). `batch_bytes`: raw bytes per record batch. The
    bytes are a view of pyarrow's output buffer (a shard is tens of MB: each copy costs a pass over it).

    The file is written into one buffer sized for the shard compressed at worst a little larger than raw
    (a growing buffer copies what it holds each time it doubles: half the encoding thread's CPU besides
    zstd); ids that compress worse than that are written again into a growing buffer, with the same bytes."""
    step = samples_per_batch(arrays, batch_bytes)
    batches = -(-arrays.num_samples // step)
    room = arrays.raw_nbytes + arrays.raw_nbytes // 64 + _FILE_SLACK + _BATCH_SLACK * batches
    buffer = pa.allocate_buffer(room)
    sink = pa.FixedSizeBufferWriter(buffer)
    try:
        raw = _write_file(sink, arrays, token_dtype=token_dtype, level=level, step=step)
    except OSError:  # "write out of bounds": larger than `room`
        sink = pa.BufferOutputStream()
        raw = _write_file(sink, arrays, token_dtype=token_dtype, level=level, step=step)
        return memoryview(sink.getvalue()), raw
    return memoryview(buffer)[:sink.tell()], raw


def _write_file(sink, arrays: ShardArrays, *, token_dtype: str, level: int, step: int) -> int:
    """Write the Arrow IPC file of `arrays` (record batches of `step` samples) to `sink`; returns raw_bytes."""
    schema = arrow_schema(token_dtype, arrays.has_doc_boundaries)
    options = pa.ipc.IpcWriteOptions(compression=pa.Codec("zstd", compression_level=level))
    raw = 0
    with pa.ipc.new_file(sink, schema, options=options) as writer:
        for lo in range(0, arrays.num_samples, step):
            hi = min(lo + step, arrays.num_samples)
            t0, t1 = arrays.sample_offsets[lo], arrays.sample_offsets[hi + 0]
            columns = [_list_array(arrays.sample_offsets[lo:hi + 1] - t0, arrays.tokens[t0:t1],
                                   numpy_token_dtype(token_dtype))]
            if arrays.has_doc_boundaries:
                d0, d1 = arrays.doc_offsets[lo], arrays.doc_offsets[hi]
                doc_offsets = arrays.doc_offsets[lo:hi + 1] - d0
                columns += [_list_array(doc_offsets, a[d0:d1], kind) for a, kind in
                            zip((arrays.doc_starts, arrays.doc_source, arrays.doc_index),
                                (DOC_STARTS_DTYPE, DOC_SOURCE_DTYPE, DOC_INDEX_DTYPE))]
            batch = pa.record_batch(columns, schema=schema)
            raw += batch_raw_bytes(batch)
            writer.write_batch(batch)
    return raw


def _flat(column: pa.ListArray, dtype: np.dtype, *, shard: str, number: int) -> tuple[np.ndarray, np.ndarray]:
    """A list column's offsets (from 0, int64) and the values they cover, read straight from its Arrow buffers:
    `to_numpy` and `flatten` give the same arrays but import pandas (when installed) and pyarrow.compute on first
    use, most of a fresh process's first batch. The values stay a read-only view of the decompressed buffer, as
    `to_numpy`'s zero-copy path left them."""
    child = column.values
    try:
        bounds = (np.frombuffer(column.buffers()[1], dtype=np.int32, count=len(column) + 1, offset=4 * column.offset)
                  if len(column) else np.zeros(1, dtype=np.int32))
        lo, hi = int(bounds[0]), int(bounds[-1])
        if lo < 0 or hi < lo or hi > len(child):
            raise ValueError(f"list offsets [{lo}, {hi}) fall outside the {len(child)} values")
        nulls = column.null_count or child.slice(lo, hi - lo).null_count
        kind = np.dtype(str(child.type))  # the schema was checked: uint16, uint32, int32 or int64
        values = (np.frombuffer(child.buffers()[1], dtype=kind, count=hi - lo, offset=kind.itemsize * (child.offset + lo))
                  if hi > lo else np.zeros(0, dtype=kind))
    except (TypeError, ValueError) as err:  # a missing buffer, or one shorter than the lengths it declares
        raise CorruptShardError(shard, f"record batch {number}: a list column is corrupt ({err})") from err
    if nulls:  # inside the lists too: numpy would turn them into arbitrary token ids
        raise CorruptShardError(shard, f"record batch {number} holds nulls")
    return bounds.astype(np.int64) - lo, values.astype(dtype, copy=False)


def decode_arrow(data: bytes | memoryview, *, token_dtype: str, shard: str, raw_bytes: int) -> ShardArrays:
    """Read an arrow shard into flat arrays, checking schema, nulls and the manifest's raw size."""
    dtype = numpy_token_dtype(token_dtype)
    buffer = pa.py_buffer(data)
    try:
        reader = pa.ipc.open_file(buffer)
    except (pa.ArrowException, OSError) as err:  # any Arrow error: invalid, not implemented, type...
        raise CorruptShardError(shard, f"not a readable Arrow IPC file ({err})") from err
    names = reader.schema.names
    has_docs = "doc_starts" in names
    expected = arrow_schema(token_dtype, has_docs)
    if not reader.schema.remove_metadata().equals(expected.remove_metadata()):
        raise CorruptShardError(shard, f"wrong Arrow schema: expected {expected.remove_metadata()}, found {reader.schema.remove_metadata()}")
    parts = _new_parts()
    seen_raw = 0
    try:
        for b, batch in enumerate(_bounded_batches(buffer, reader, shard, raw_bytes)):
            seen_raw += batch_raw_bytes(batch)
            if seen_raw > raw_bytes:
                raise CorruptShardError(shard, f"decompresses past the {raw_bytes} raw bytes the manifest allows")
            _add_batch(parts, batch, dtype=dtype, has_docs=has_docs, shard=shard, number=b)
    except (pa.ArrowException, OSError) as err:
        raise CorruptShardError(shard, f"Arrow data is corrupt ({err})") from err
    if seen_raw != raw_bytes:
        raise CorruptShardError(shard, f"payload is {seen_raw} bytes, the manifest says {raw_bytes}")
    return _assemble(parts, dtype=dtype, has_docs=has_docs, shard=shard)


def _new_parts() -> dict[str, list[np.ndarray]]:
    return {"tokens": [], "lengths": [], "doc_counts": [], "doc_starts": [], "doc_source": [], "doc_index": []}


def _add_batch(parts: dict[str, list[np.ndarray]], batch: pa.RecordBatch, *, dtype: np.dtype, has_docs: bool,
               shard: str, number: int) -> None:
    offsets, values = _flat(batch.column("tokens"), dtype, shard=shard, number=number)
    parts["tokens"].append(values)
    parts["lengths"].append(np.diff(offsets))
    if has_docs:
        doc_offsets, starts = _flat(batch.column("doc_starts"), DOC_STARTS_DTYPE, shard=shard, number=number)
        for name, kind in (("doc_source", DOC_SOURCE_DTYPE), ("doc_index", DOC_INDEX_DTYPE)):
            other_offsets, values = _flat(batch.column(name), kind, shard=shard, number=number)
            if not np.array_equal(other_offsets, doc_offsets):
                raise CorruptShardError(shard, f"record batch {number}: {name} does not line up with doc_starts")
            parts[name].append(values)
        parts["doc_starts"].append(starts)
        parts["doc_counts"].append(np.diff(doc_offsets))


def _assemble(parts: dict[str, list[np.ndarray]], *, dtype: np.dtype, has_docs: bool, shard: str,
              views: bool = False) -> ShardArrays:
    """One set of arrays from the batches' parts. With `views`, a single batch's arrays stay views of the
    bytes they were decoded from (a block, copied into place by its reader at once: a copy here was a
    third of decoding a block); otherwise every array is a copy that owns its memory."""
    def concat(key: str, kind: np.dtype) -> np.ndarray:
        if views and len(parts[key]) == 1:
            return parts[key][0].astype(kind, copy=False)
        return np.concatenate(parts[key]).astype(kind, copy=False) if parts[key] else np.zeros(0, kind)

    lengths = concat("lengths", np.dtype(np.int64))
    offsets = np.zeros(len(lengths) + 1, dtype=OFFSETS_DTYPE)
    np.cumsum(lengths, out=offsets[1:])
    if not has_docs:
        arrays = ShardArrays(concat("tokens", dtype), offsets)
    else:
        counts = concat("doc_counts", np.dtype(np.int64))
        doc_offsets = np.zeros(len(counts) + 1, dtype=OFFSETS_DTYPE)
        np.cumsum(counts, out=doc_offsets[1:])
        arrays = ShardArrays(concat("tokens", dtype), offsets, doc_offsets, concat("doc_starts", DOC_STARTS_DTYPE),
                             concat("doc_source", DOC_SOURCE_DTYPE), concat("doc_index", DOC_INDEX_DTYPE))
    arrays.validate(shard)
    return arrays


def record_batch_ranges(data: bytes) -> list[tuple[int, int]]:
    """Byte range [start, end) of every record batch message of an Arrow IPC file, in order (format v2
    blocks); the schema message before them and the end-of-stream marker after are not included."""
    source = pa.BufferReader(pa.py_buffer(data).slice(_FILE_MAGIC_BYTES))
    messages = pa.ipc.MessageReader.open_stream(source)
    ranges, start = [], _FILE_MAGIC_BYTES
    while True:
        try:
            message = messages.read_next_message()
        except StopIteration:
            return ranges
        end = _FILE_MAGIC_BYTES + source.tell()
        if message.type == "record batch":
            ranges.append((start, end))
        start = end


def decode_arrow_block(data: bytes | memoryview, *, token_dtype: str, has_docs: bool, shard: str, raw_bytes: int,
                       number: int) -> ShardArrays:
    """Decode one record batch message (a format v2 block) with the schema the manifest implies; its
    declared buffer sizes are bounded by the block's `raw_bytes` before pyarrow decompresses anything."""
    dtype = numpy_token_dtype(token_dtype)
    parts = _new_parts()
    try:
        message = pa.ipc.read_message(pa.py_buffer(data))
        if message.type != "record batch":
            raise CorruptShardError(shard, f"block {number} is an Arrow {message.type} message, not a record batch")
        declared, count = declared_batch_bytes(message.metadata, message.body or b"", shard)
        if declared > raw_bytes + _SLACK_PER_BUFFER * count:
            raise CorruptShardError(shard, f"block {number} declares {declared} uncompressed bytes, more than its "
                                           f"{raw_bytes} raw bytes (refused before decompressing)")
        batch = pa.ipc.read_record_batch(message, arrow_schema(token_dtype, has_docs))
        if batch_raw_bytes(batch) != raw_bytes:
            raise CorruptShardError(shard, f"block {number} holds {batch_raw_bytes(batch)} raw bytes, its index "
                                           f"entry says {raw_bytes}")
        _add_batch(parts, batch, dtype=dtype, has_docs=has_docs, shard=shard, number=number)
    except (pa.ArrowException, OSError) as err:
        raise CorruptShardError(shard, f"block {number}: Arrow data is corrupt ({err})") from err
    return _assemble(parts, dtype=dtype, has_docs=has_docs, shard=shard, views=True)


def _bounded_batches(buffer: pa.Buffer, reader: pa.ipc.RecordBatchFileReader, shard: str, raw_bytes: int):
    """Yield the record batches in stream order, refusing any whose declared buffer sizes would take
    the shard past `raw_bytes` *before* pyarrow allocates and decompresses them (zstd bombs).

    Batches are read from the IPC stream inside the file rather than through the footer, so exactly
    the bytes that were checked are decoded; the footer must index as many batches as the stream holds.
    """
    messages = pa.ipc.MessageReader.open_stream(pa.BufferReader(buffer.slice(_FILE_MAGIC_BYTES)))
    declared_total = buffer_count = batches = 0
    first = True
    while True:
        try:
            message = messages.read_next_message()
        except StopIteration:
            break
        if first:
            first = False
            if message.type != "schema":
                raise CorruptShardError(shard, f"Arrow IPC stream starts with a {message.type} message, not the schema")
            continue
        if message.type != "record batch":
            raise CorruptShardError(shard, f"unexpected Arrow IPC {message.type} message (shards hold record batches only)")
        declared, count = declared_batch_bytes(message.metadata, message.body or b"", shard)
        declared_total += declared
        buffer_count += count
        if declared_total > raw_bytes + _SLACK_PER_BUFFER * buffer_count:
            raise CorruptShardError(shard, f"record batch {batches} declares {declared} uncompressed bytes, taking the "
                                           f"shard past the {raw_bytes} raw bytes the manifest allows (refused before "
                                           "decompressing)")
        yield pa.ipc.read_record_batch(message, reader.schema)
        batches += 1
    if batches != reader.num_record_batches:
        raise CorruptShardError(shard, f"the Arrow footer indexes {reader.num_record_batches} record batches, "
                                       f"the stream holds {batches}")
