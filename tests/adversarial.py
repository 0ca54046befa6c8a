"""Builders of hostile shards and manifests for the adversarial and fuzz tests.

Everything here makes bytes in memory: zstd bombs (a small frame that inflates far past what the
manifest allows), tar archives with links, traversal names and lying headers, Arrow IPC files whose
buffers declare more than the manifest's raw size.
"""

from __future__ import annotations

import io
import struct
import tarfile

import numpy as np
import numpy.lib.format as npy_format
import zstandard

from shardkit.formats import Sample, arrays_from_samples, encode_shard
from shardkit.formats.arrow_ipc import record_batch_buffers

BLOCK = 512


def zeros_frame(size: int, *, declare_size: bool) -> bytes:
    """A zstd frame of `size` zero bytes, built in 16 MiB steps (never holds `size` bytes)."""
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=declare_size)
    obj = cctx.compressobj(size=size if declare_size else -1)
    step = min(size, 1 << 24)
    chunk = b"\0" * step
    parts, left = [], size
    while left:
        n = min(step, left)
        parts.append(obj.compress(chunk[:n]))
        left -= n
    parts.append(obj.flush())
    return b"".join(parts)


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    npy_format.write_array(buf, array, allow_pickle=False)
    return buf.getvalue()


def tar_member(name: str, payload: bytes, *, kind: bytes = tarfile.REGTYPE, linkname: str = "",
               size: int | None = None) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = len(payload) if size is None else size
    info.type = kind
    info.linkname = linkname
    info.mtime = 0
    header = info.tobuf(format=tarfile.GNU_FORMAT if len(name) > 100 else tarfile.USTAR_FORMAT)
    return header + payload + b"\0" * (-len(payload) % BLOCK)


def tar_end() -> bytes:
    return b"\0" * (2 * BLOCK)


def tokens_member(index: int, tokens: np.ndarray) -> tuple[bytes, int]:
    """A valid tokens member and its raw (decompressed) size."""
    raw = npy_bytes(tokens)
    return tar_member(f"{index:09d}.tokens.npy.zst", zstandard.ZstdCompressor().compress(raw)), len(raw)


def set_header_field(data: bytes, header_at: int, offset: int, value: bytes) -> bytes:
    """Overwrite a field of the tar header at `header_at` and fix the header checksum."""
    out = bytearray(data)
    out[header_at + offset:header_at + offset + len(value)] = value
    header = out[header_at:header_at + BLOCK]
    header[148:156] = b" " * 8
    out[header_at + 148:header_at + 156] = b"%06o\0 " % sum(header)
    return bytes(out)


def arrow_shard(num_samples: int = 60, length: int = 1000, seed: int = 0):
    """A valid arrow shard (one record batch, no doc columns) and its encoded facts."""
    rng = np.random.default_rng(seed)
    samples = [Sample(rng.integers(0, 50000, length)) for _ in range(num_samples)]
    return encode_shard(arrays_from_samples(samples, "uint16"), shard_format="arrow", token_dtype="uint16")


def arrow_bomb(size: int, *, declare_size: bool) -> tuple[bytes, int]:
    """An arrow shard whose token-values buffer declares and inflates to `size` bytes of zeros.

    The buffer's slot keeps its length (the frame is padded with a zstd skippable frame), so the
    IPC metadata and footer stay valid and only the buffer contents lie. Returns (bytes, raw_bytes).
    """
    encoded = arrow_shard()
    data = bytearray(encoded.data)
    pos = 8  # after "ARROW1\0\0": continuation marker, metadata length, metadata, body
    schema_len = struct.unpack_from("<i", data, pos + 4)[0]
    pos += 8 + schema_len
    meta_len = struct.unpack_from("<i", data, pos + 4)[0]
    buffers, compressed = record_batch_buffers(bytes(data[pos + 8:pos + 8 + meta_len]), "bomb")
    assert compressed
    body = pos + 8 + meta_len
    offset, length = max(buffers, key=lambda b: b[1])  # the token values
    frame = zeros_frame(size, declare_size=declare_size)
    pad = length - 8 - len(frame) - 8
    if pad < 0:
        raise ValueError(f"a {size}-byte bomb frame ({len(frame)} bytes) does not fit the {length}-byte slot")
    data[body + offset:body + offset + length] = (struct.pack("<q", size) + frame
                                                  + struct.pack("<II", 0x184D2A50, pad) + b"\0" * pad)
    return bytes(data), encoded.raw_bytes
