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


def test_the_crc_is_checked_once_per_file_identity_and_again_after_any_change(tmp_path, monkeypatch):
    """Issue 23: reopening an unchanged file skips the CRC (an epoch reopens every shard); a file changed in
    place, keeping its size, is checked again and refused."""
    from shardkit.formats import decoded

    checks = []
    real_check = decoded._check_crc
    monkeypatch.setattr(decoded, "_check_crc", lambda *a: (checks.append(a[2]), real_check(*a)))
    path = tmp_path / "once.decoded"
    write_decoded(str(path), arrays_from_samples([Sample(np.arange(5000) % 300)] * 8, "uint16"), shard_sha256=SHA_A)
    for _ in range(3):
        open_decoded(str(path), shard="s", shard_sha256=SHA_A)
    assert len(checks) == 1  # one check for three opens of the same file
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a token changed in place: same inode, same size, a later mtime
    stat = path.stat()
    with open(path, "r+b") as fh:
        fh.write(bytes(data))
    import os

    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # as a write a tick later sets it
    with pytest.raises(CorruptShardError, match="damaged"):
        open_decoded(str(path), shard="s", shard_sha256=SHA_A)
    assert len(checks) == 2
