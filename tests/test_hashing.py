"""The one streaming SHA-256 (shardkit.hashing): the same digest as hashing the bytes whole, whatever the
piece boundaries, bounded reads that stop where asked, and the byte count."""

from __future__ import annotations

import hashlib
import io

import pytest

from shardkit import hashing
from shardkit.hashing import file_sha256, read_pieces, sha256_pieces


@pytest.mark.parametrize("length", [0, 1, 6, 7, 8, 50])
def test_a_file_hashes_to_the_digest_of_its_bytes_across_piece_boundaries(tmp_path, monkeypatch, length):
    monkeypatch.setattr(hashing, "PIECE_BYTES", 7)  # many pieces, a last one short or full
    data = bytes(range(length))
    path = tmp_path / "vocab.json"
    path.write_bytes(data)
    assert file_sha256(str(path)) == hashlib.sha256(data).hexdigest()
    size, digest = sha256_pieces(read_pieces(io.BytesIO(data)))
    assert (size, digest.digest()) == (length, hashlib.sha256(data).digest())


def test_a_bounded_read_stops_at_its_size_and_leaves_the_rest(monkeypatch):
    # The binary index: its checksum covers every byte before the last 32, which the reader compares.
    monkeypatch.setattr(hashing, "PIECE_BYTES", 5)
    data = b"x" * 23 + b"checksum"
    fh = io.BytesIO(data)
    size, digest = sha256_pieces(read_pieces(fh, 23))
    assert (size, digest.digest()) == (23, hashlib.sha256(data[:23]).digest())
    assert fh.read() == b"checksum"
    assert sha256_pieces(read_pieces(io.BytesIO(b"short"), 100))[0] == 5  # a file that ends first: what there is


def test_pieces_of_any_source_hash_like_the_whole():
    # The remote manifest JSON: ranged reads of an object, hashed as they arrive.
    data = b'{"shards": []}' * 1000
    pieces = (data[start:start + 4096] for start in range(0, len(data), 4096))
    size, digest = sha256_pieces(pieces)
    assert (size, digest.hexdigest()) == (len(data), hashlib.sha256(data).hexdigest())
