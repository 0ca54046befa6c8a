"""Decoded cache files (.skd): broken, damaged, stale or foreign files are refused."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from shardkit.errors import CorruptShardError
from shardkit.formats import Sample, arrays_from_samples, open_decoded, write_decoded
from shardkit.formats.decoded import TRAILER, TRAILER_MAGIC

SHA_A, SHA_B = "a" * 64, "b" * 64


def with_fresh_crc(body: bytes) -> bytes:
    """`body` (a file without its trailer) with a trailer that matches it, as a forger would write."""
    return body + TRAILER.pack(TRAILER_MAGIC, zlib.crc32(body))


def test_broken_decoded_cache_files_are_rejected(tmp_path):
    path = tmp_path / "cache.decoded"
    write_decoded(str(path), arrays_from_samples([Sample(np.arange(100))] * 4, "uint16"))
    good = path.read_bytes()
    path.write_bytes(good[: len(good) - 300])
    with pytest.raises(CorruptShardError, match="s1: .*truncated"):
        open_decoded(str(path), shard="s1")
    # The structural checks still hold for a file whose CRC was recomputed after cutting it.
    path.write_bytes(with_fresh_crc(good[: len(good) - TRAILER.size - 300]))
    with pytest.raises(CorruptShardError, match="s1: .*lies outside the file"):
        open_decoded(str(path), shard="s1")
    path.write_bytes(b"NOTSHARD" + good[8:])
    with pytest.raises(CorruptShardError, match="not a shardkit decoded-shard file"):
        open_decoded(str(path), shard="s1")
    path.write_bytes(good[:10])
    with pytest.raises(CorruptShardError, match="truncated"):
        open_decoded(str(path), shard="s1")


def test_a_changed_byte_anywhere_fails_the_crc(tmp_path):
    path = tmp_path / "s.skd"
    write_decoded(str(path), arrays_from_samples([Sample(np.arange(100))] * 4, "uint16"), shard_sha256=SHA_A)
    good = path.read_bytes()
    header_end = 16 + int.from_bytes(good[8:16], "little")
    for offset in (header_end + 2, len(good) - TRAILER.size - 1):  # a token, the last padding byte
        damaged = bytearray(good)
        damaged[offset] ^= 0x01
        path.write_bytes(bytes(damaged))
        with pytest.raises(CorruptShardError, match=f"{path} is damaged \\(CRC-32"):
            open_decoded(str(path), shard="s", shard_sha256=SHA_A)
    path.write_bytes(good)
    assert open_decoded(str(path), shard="s", shard_sha256=SHA_A).tokens[:3].tolist() == [0, 1, 2]


def test_a_file_of_another_shard_or_an_older_format_is_refused(tmp_path):
    path = tmp_path / "s.skd"
    arrays = arrays_from_samples([Sample(np.arange(10))] * 2, "uint16")
    write_decoded(str(path), arrays, shard_sha256=SHA_B)
    with pytest.raises(CorruptShardError, match=f"{path} was decoded from another shard \\(SHA-256 bbbb"):
        open_decoded(str(path), shard="s", shard_sha256=SHA_A)
    write_decoded(str(path), arrays)  # bound to no shard
    with pytest.raises(CorruptShardError, match="decoded from another shard \\(SHA-256 None"):
        open_decoded(str(path), shard="s", shard_sha256=SHA_A)
    good = path.read_bytes()
    header_len = int.from_bytes(good[8:16], "little")
    header = good[16:16 + header_len].replace(b'"version": 2', b'"version": 1')
    path.write_bytes(with_fresh_crc(good[:16] + header + good[16 + header_len:-TRAILER.size]))
    with pytest.raises(CorruptShardError, match="unsupported header \\(version 1, expected 2\\)"):
        open_decoded(str(path), shard="s")
    assert struct.calcsize("<8sI4x") == TRAILER.size == 16
