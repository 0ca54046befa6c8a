"""Just enough of the Arrow IPC message layout to bound decompression before pyarrow runs it.

With buffer compression, every buffer in a record batch body is `[int64 uncompressed length][zstd
frame]`, and pyarrow allocates that declared length and decompresses into it before anything can
be checked. A hostile shard could declare gigabytes in a few kilobytes. So, before a record batch
is decoded, its metadata (a flatbuffer `Message` whose header is a `RecordBatch`) is read here to
locate the buffers, and their declared lengths are summed: the caller refuses the batch when the
sum exceeds what the manifest allows.

Flatbuffer layout used (format/Message.fbs): Message { version: short, header_type: ubyte,
header: table, bodyLength: long, ... }; RecordBatch { length: long, nodes: [FieldNode],
buffers: [Buffer], compression: BodyCompression }; Buffer is a struct { offset: long, length: long }.
"""

from __future__ import annotations

import struct

from shardkit.errors import CorruptShardError

RECORD_BATCH_HEADER = 3  # MessageHeader union tag of RecordBatch
_NOT_COMPRESSED = -1  # a length prefix of -1 marks a buffer stored uncompressed


class _Flatbuffer:
    """Bounds-checked little-endian reads from a flatbuffer."""

    def __init__(self, data: bytes, shard: str):
        self.data = data
        self.shard = shard

    def read(self, fmt: str, pos: int) -> int:
        size = struct.calcsize(fmt)
        if pos < 0 or pos + size > len(self.data):
            raise CorruptShardError(self.shard, "Arrow IPC message metadata is truncated or malformed")
        return struct.unpack_from(fmt, self.data, pos)[0]

    def field(self, table: int, index: int) -> int | None:
        """Absolute position of field `index` of the table at `table`, or None when absent."""
        vtable = table - self.read("<i", table)
        vtable_size = self.read("<H", vtable)
        if 4 + 2 * index + 2 > vtable_size:
            return None
        offset = self.read("<H", vtable + 4 + 2 * index)
        return table + offset if offset else None

    def indirect(self, pos: int) -> int:
        return pos + self.read("<I", pos)


def record_batch_buffers(metadata: bytes, shard: str) -> tuple[list[tuple[int, int]], bool]:
    """(offset, length) of every body buffer of a record batch message, and whether it is compressed."""
    fb = _Flatbuffer(bytes(metadata), shard)
    root = fb.indirect(0)
    kind_pos = fb.field(root, 1)
    if kind_pos is None or fb.read("<B", kind_pos) != RECORD_BATCH_HEADER:
        raise CorruptShardError(shard, "Arrow IPC message is not a record batch")
    header_pos = fb.field(root, 2)
    if header_pos is None:
        raise CorruptShardError(shard, "Arrow IPC record batch message has no header")
    header = fb.indirect(header_pos)
    buffers_pos = fb.field(header, 2)
    buffers: list[tuple[int, int]] = []
    if buffers_pos is not None:
        vector = fb.indirect(buffers_pos)
        count = fb.read("<I", vector)
        if count > (len(fb.data) - vector) // 16:
            raise CorruptShardError(shard, "Arrow IPC buffer list runs past its metadata")
        buffers = [(fb.read("<q", vector + 4 + 16 * i), fb.read("<q", vector + 12 + 16 * i)) for i in range(count)]
    return buffers, fb.field(header, 3) is not None


def declared_batch_bytes(metadata: bytes, body: bytes | memoryview, shard: str) -> tuple[int, int]:
    """(bytes pyarrow will allocate to decode this record batch, number of buffers), from its headers."""
    buffers, compressed = record_batch_buffers(metadata, shard)
    body = memoryview(body)
    total = 0
    for offset, length in buffers:
        if offset < 0 or length < 0 or offset + length > len(body):
            raise CorruptShardError(shard, f"Arrow IPC buffer ({offset}, {length}) lies outside the message body")
        if not compressed or length == 0:
            total += length
            continue
        if length < 8:
            raise CorruptShardError(shard, "Arrow IPC compressed buffer lacks its length prefix")
        declared = struct.unpack_from("<q", body, offset)[0]
        if declared == _NOT_COMPRESSED:
            total += length - 8
        elif declared < 0:
            raise CorruptShardError(shard, f"Arrow IPC buffer declares a negative size ({declared})")
        else:
            total += declared
    return total, len(buffers)
