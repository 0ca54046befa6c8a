"""Hostile input against the core: every case is refused with a clear CorruptShardError or
ManifestError naming the shard, nothing is written anywhere, and memory stays bounded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import zstandard

from adversarial import (arrow_bomb, arrow_shard, npy_bytes, set_header_field, tar_end, tar_member, tokens_member,
                         zeros_frame)
from shardkit.errors import CorruptShardError, ManifestError
from shardkit.formats import (Sample, ShardReader, arrays_from_samples, decode_shard, encode_shard, open_decoded,
                              write_dataset, write_decoded)
from shardkit.manifest import Manifest, TokenizerInfo, load_manifest

HERE = Path(__file__).resolve().parent
BOMB_SIZE = 1 << 30  # 1 GiB of zeros in ~32 KiB of zstd
TOKENS = np.arange(10, dtype="<u2")


def tar_decode(data: bytes, raw_bytes: int):
    return decode_shard(data, shard_format="tar", token_dtype="uint16", shard="evil.tar", raw_bytes=raw_bytes)


# -- manifests --------------------------------------------------------------------------------------
def manifest_dict(tmp_path) -> dict:
    manifest = write_dataset(str(tmp_path / "ds"), [Sample(TOKENS)] * 4, seq_len=9, packing="concat",
                             tokenizer=TokenizerInfo(kind="byte", name="byte", vocab_size=259), max_samples=2)
    return json.loads(manifest.to_json())


@pytest.mark.parametrize("name", ["../escape.tar", "a/../../escape.tar", "/etc/passwd", "C:/x.tar", "s3://other/x.tar",
                                  "a\\..\\x.tar", "./x.tar", "a//b.tar", "x\x00.tar", ""])
def test_manifest_with_unsafe_shard_name_is_refused(tmp_path, name, figures):
    data = manifest_dict(tmp_path)
    data["shards"][0]["name"] = name
    with pytest.raises(ManifestError, match="unsafe shard name|must be a non-empty string"):
        Manifest.from_dict(data, source="evil/shardkit.json")
    # Through storage too: the error names the manifest's URL.
    (tmp_path / "ds" / "shardkit.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=r"ds/shardkit\.json"):
        load_manifest(str(tmp_path / "ds"))
    figures.add("adversarial_manifests", runs=1, refused=1)


def test_manifest_totals_and_duplicates_are_checked(tmp_path):
    data = manifest_dict(tmp_path)
    lying = dict(data, totals=dict(data["totals"], samples=data["totals"]["samples"] + 1))
    with pytest.raises(ManifestError, match="totals"):
        Manifest.from_dict(lying)
    twice = dict(data, shards=[data["shards"][0], data["shards"][0]], totals=None)
    with pytest.raises(ManifestError, match="same shard twice"):
        Manifest.from_dict(twice)


@pytest.mark.parametrize("field,value", [("samples", 3), ("tokens", 21), ("raw_bytes", 1), ("compressed_bytes", 5),
                                         ("sha256", "0" * 64), ("has_doc_boundaries", True)])
def test_manifest_shard_mismatch_is_refused(tmp_path, field, value):
    manifest = Manifest.from_dict(manifest_dict(tmp_path))
    shard = manifest.shards[0]
    data = (tmp_path / "ds" / shard.name).read_bytes()
    from dataclasses import replace
    lying = replace(shard, **{field: value})
    with pytest.raises(CorruptShardError, match=shard.name):
        ShardReader.from_bytes(data, shard=lying, manifest=manifest)


# -- tar shards -------------------------------------------------------------------------------------
def valid_tar() -> tuple[bytes, int]:
    m0, r0 = tokens_member(0, TOKENS)
    m1, r1 = tokens_member(1, TOKENS)
    return m0 + m1 + tar_end(), r0 + r1


def test_valid_tar_baseline_decodes():
    data, raw = valid_tar()
    assert tar_decode(data, raw).num_samples == 2


TAR_CASES = {
    "traversal": lambda m, r: tar_member("../000000000.tokens.npy.zst", m),
    "absolute": lambda m, r: tar_member("/tmp/000000000.tokens.npy.zst", m),
    "nested": lambda m, r: tar_member("a/000000000.tokens.npy.zst", m),
    "symlink": lambda m, r: tar_member("000000000.tokens.npy.zst", b"", kind=tarfile.SYMTYPE, linkname="/etc/passwd"),
    "hardlink": lambda m, r: tar_member("000000000.tokens.npy.zst", b"", kind=tarfile.LNKTYPE, linkname="../x"),
    "directory": lambda m, r: tar_member("000000000.tokens.npy.zst", b"", kind=tarfile.DIRTYPE),
    "fifo": lambda m, r: tar_member("000000000.tokens.npy.zst", b"", kind=tarfile.FIFOTYPE),
    "gnu-longname": lambda m, r: tar_member("0" * 120 + ".tokens.npy.zst", m),
    "absurd-size": lambda m, r: tar_member("000000000.tokens.npy.zst", m, size=8**11 - 1),
    "pickle": lambda m, r: tar_member("000000000.tokens.npy.zst", zstandard.ZstdCompressor().compress(
        npy_bytes(np.array([{"x": 1}], dtype=object)) if False else b"\x93NUMPY\x01\x00v\x00{'descr': '|O', "
        b"'fortran_order': False, 'shape': (1,), }" + b" " * 60 + b"\n" + b"\x80\x04K\x01.")),
    "not-zstd": lambda m, r: tar_member("000000000.tokens.npy.zst", b"hello, this is not zstd at all"),
    "wrong-dtype": lambda m, r: tar_member("000000000.tokens.npy.zst",
                                           zstandard.ZstdCompressor().compress(npy_bytes(TOKENS.astype("<i8")))),
    "out-of-order": lambda m, r: tokens_member(1, TOKENS)[0],
}


@pytest.mark.parametrize("case", sorted(TAR_CASES))
def test_hostile_tar_member_is_refused(tmp_path, case, monkeypatch, figures):
    member, raw = tokens_member(0, TOKENS)
    frame = member[512:512 + int(member[124:136].split(b"\0")[0], 8)]
    data = TAR_CASES[case](frame, raw) + tar_end()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CorruptShardError, match="evil.tar") as info:
        tar_decode(data, raw)
    assert len(str(info.value)) < 400  # a message, not a dump
    assert list(tmp_path.iterdir()) == []  # nothing was extracted anywhere
    figures.add("adversarial_tar", runs=1, refused=1)


def test_tar_header_lies_are_refused():
    data, raw = valid_tar()
    bad_checksum = bytearray(data)
    bad_checksum[0] ^= 1
    cases = {
        "bad checksum": bytes(bad_checksum),
        "base-256 size": set_header_field(data, 0, 124, b"\x80" + b"\0" * 3 + b"\x7f" * 8),
        "non-octal size": set_header_field(data, 0, 124, b"12345678zz\0"),
        "truncated header": data[:512 + 512 + 100],
        "truncated member": data[:600],
        "no end marker": data[:len(data) - 1024],
        "empty": b"",
    }
    for label, blob in cases.items():
        with pytest.raises(CorruptShardError, match="evil.tar"):
            tar_decode(blob, raw)
        # and under any raw_bytes the manifest might claim
        with pytest.raises(CorruptShardError):
            tar_decode(blob, 10**9)


def test_tar_duplicate_and_missing_members():
    m0, r0 = tokens_member(0, TOKENS)
    with pytest.raises(CorruptShardError, match="twice"):
        tar_decode(m0 + m0 + tar_end(), 2 * r0)
    docs = tar_member("000000000.docs.npy.zst", zstandard.ZstdCompressor().compress(npy_bytes(np.zeros((1, 3), "<i8"))))
    with pytest.raises(CorruptShardError, match="no tokens member"):
        tar_decode(docs + tar_end(), 10**6)


# -- arrow shards -----------------------------------------------------------------------------------
def arrow_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


ARROW_CASES = {
    "int64 tokens": pa.table({"tokens": pa.array([[1, 2, 3]], pa.list_(pa.int64()))}),
    "extra column": pa.table({"tokens": pa.array([[1, 2]], pa.list_(pa.uint16())), "x": pa.array([1])}),
    "no tokens": pa.table({"doc_starts": pa.array([[0]], pa.list_(pa.int32()))}),
    "flat tokens": pa.table({"tokens": pa.array([1, 2, 3], pa.uint16())}),
    "string tokens": pa.table({"tokens": pa.array([["a"]], pa.list_(pa.string()))}),
    "nulls": pa.table({"tokens": pa.array([[1, 2], None], pa.list_(pa.uint16()))}),
    "null values": pa.table({"tokens": pa.array([[1, None]], pa.list_(pa.uint16()))}),
    "docs misaligned": pa.table({
        "tokens": pa.array([[1, 2, 3]], pa.list_(pa.uint16())),
        "doc_starts": pa.array([[0, 1]], pa.list_(pa.int32())),
        "doc_source": pa.array([[0]], pa.list_(pa.int32())),
        "doc_index": pa.array([[0, 1]], pa.list_(pa.int64()))}),
}


@pytest.mark.parametrize("case", sorted(ARROW_CASES))
def test_hostile_arrow_shard_is_refused(case, figures):
    table = ARROW_CASES[case]
    if case.startswith("null") or case == "docs misaligned":
        # Right schema (non-nullable fields are only metadata): the contents must still be refused.
        fields = [pa.field(f.name, f.type, nullable=False) for f in table.schema]
        table = pa.Table.from_arrays(table.columns, schema=pa.schema(fields))
    data = arrow_bytes(table)
    # The raw size the file really has, so that only the case itself can be the reason for refusal.
    raw = sum(b.nbytes for b in pa.ipc.open_file(pa.py_buffer(data)).read_all().to_batches())
    with pytest.raises(CorruptShardError, match="evil.arrow") as info:
        decode_shard(data, shard_format="arrow", token_dtype="uint16", shard="evil.arrow", raw_bytes=raw)
    assert "manifest says" not in str(info.value), info.value
    figures.add("adversarial_arrow", runs=1, refused=1)


def test_arrow_garbage_and_truncation_are_refused():
    encoded = arrow_shard(num_samples=5, length=50)
    for blob in (b"", b"ARROW1", encoded.data[:len(encoded.data) // 2], encoded.data[:-7], b"x" * 4096):
        with pytest.raises(CorruptShardError, match="evil.arrow"):
            decode_shard(blob, shard_format="arrow", token_dtype="uint16", shard="evil.arrow", raw_bytes=encoded.raw_bytes)


# -- zstd bombs and memory --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bombs(tmp_path_factory) -> dict[str, tuple[Path, str, int]]:
    """Four 1 GiB zstd bombs on disk: (path, shard_format, raw_bytes the manifest claims)."""
    root = tmp_path_factory.mktemp("bombs")
    out = {}
    for declared in (True, False):
        label = "declared" if declared else "undeclared"
        frame = zeros_frame(BOMB_SIZE, declare_size=declared)
        member = tar_member("000000000.tokens.npy.zst", frame)
        (root / f"tar-{label}").write_bytes(member + tar_end())
        out[f"tar-{label}"] = (root / f"tar-{label}", "tar", 4096)
        data, raw = arrow_bomb(BOMB_SIZE, declare_size=declared)
        (root / f"arrow-{label}").write_bytes(data)
        out[f"arrow-{label}"] = (root / f"arrow-{label}", "arrow", raw)
    return out


PEAK_RSS_SCRIPT = """
import json, resource, sys
from shardkit.formats import decode_shard
path, fmt, raw = sys.argv[1], sys.argv[2], int(sys.argv[3])
data = open(path, "rb").read()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    decode_shard(data, shard_format=fmt, token_dtype="uint16", shard="bomb", raw_bytes=raw)
    error = None
except Exception as err:
    error = [type(err).__name__, str(err)]
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"before_kb": before, "after_kb": after, "error": error}))
"""


@pytest.mark.parametrize("bomb", ["tar-declared", "tar-undeclared", "arrow-declared", "arrow-undeclared"])
def test_zstd_bomb_is_refused_in_bounded_memory(bombs, bomb, figures):
    path, fmt, raw = bombs[bomb]
    assert path.stat().st_size < 200_000  # a small file...
    result = subprocess.run([sys.executable, "-c", PEAK_RSS_SCRIPT, str(path), fmt, str(raw)],
                            capture_output=True, text=True, timeout=120, cwd=HERE.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["error"] is not None and report["error"][0] == "CorruptShardError", report
    assert "bomb" in report["error"][1]
    grown_mb = (report["after_kb"] - report["before_kb"]) / 1024
    assert grown_mb < 64, f"{bomb}: decoding a {BOMB_SIZE >> 20} MiB bomb grew peak RSS by {grown_mb:.0f} MB"
    figures.add(f"zstd_bomb_{bomb}", runs=1, bomb_mib=BOMB_SIZE >> 20, peak_rss_growth_mb=round(grown_mb, 1))


def test_bomb_within_declared_limit_but_inflating_past_it_is_refused():
    """A frame that declares a small size but inflates further (tar): stopped at the manifest's bound."""
    frame = zeros_frame(1 << 26, declare_size=False)
    data = tar_member("000000000.tokens.npy.zst", frame) + tar_end()
    with pytest.raises(CorruptShardError, match="decompresses past the 1000 bytes allowed"):
        tar_decode(data, 1000)


# -- decoded cache files ----------------------------------------------------------------------------
def test_tampered_decoded_cache_file_is_refused(tmp_path):
    arrays = arrays_from_samples([Sample(TOKENS)] * 3, "uint16")
    path = tmp_path / "s.decoded"
    write_decoded(str(path), arrays)
    good = path.read_bytes()
    header_end = 16 + int.from_bytes(good[8:16], "little")
    cases = {
        "truncated": good[:len(good) // 2],
        "short": good[:10],
        "magic": b"XXXXXXXX" + good[8:],
        "offsets past end": good[:16] + good[16:header_end].replace(b'"count": 30', b'"count": 99') + good[header_end:],
        "object dtype": good[:16] + good[16:header_end].replace(b'"<u2"', b'"|O8"') + good[header_end:],
    }
    for label, blob in cases.items():
        path.write_bytes(blob)
        with pytest.raises(CorruptShardError, match="s.tar"):
            open_decoded(str(path), shard="s.tar")
    assert sorted(os.listdir(tmp_path)) == ["s.decoded"]


def test_encode_refuses_out_of_range_tokens():
    with pytest.raises(ValueError, match="token ids"):
        encode_shard(arrays_from_samples([Sample(np.array([70000]))], "uint16"), shard_format="tar", token_dtype="uint16")
