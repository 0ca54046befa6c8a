"""The tar shard format: WebDataset interop, hostile archives, deterministic bytes, the fast encoder."""

from __future__ import annotations

import numpy as np
import pytest
from format_samples import build_tar, make_samples, zst_npy

from shardkit.errors import CorruptShardError
from shardkit.formats import (
    Sample,
    arrays_from_samples,
    tar_format,
    wds_decode_hook,
    write_dataset,
)
from shardkit.formats.zstd_frames import compressor
from shardkit.manifest import TokenizerInfo


def test_webdataset_reads_tar_shard(tmp_path):
    wds = pytest.importorskip("webdataset")
    rng = np.random.default_rng(2)
    samples = make_samples(rng, 12, 50257)
    url = str(tmp_path / "ds")
    manifest = write_dataset(url, samples, tokenizer=TokenizerInfo(kind="byte", name="t", vocab_size=50257),
                             seq_len=None, packing="none")
    dataset = wds.WebDataset(str(tmp_path / "ds" / manifest.shards[0].name), shardshuffle=False).decode(wds_decode_hook)
    records = list(dataset)
    assert len(records) == len(samples)
    for want, record in zip(samples, records):
        np.testing.assert_array_equal(record["tokens.npy.zst"], want.tokens)
        np.testing.assert_array_equal(record["docs.npy.zst"][:, 0], want.doc_starts)

GOOD = zst_npy(np.arange(5, dtype="<u2"))

@pytest.mark.parametrize(("members", "match"), [
    ([({"name": "../000000000.tokens.npy.zst"}, GOOD)], "unexpected tar member '../000000000"),
    ([({"name": "/000000000.tokens.npy.zst"}, GOOD)], "unexpected tar member '/000000000"),
    ([({"name": "a/../../000000000.tokens.npy.zst"}, GOOD)], "unexpected tar member"),
    ([({"name": "000000000.tokens.npy.zst", "type": b"2", "linkname": "/etc/passwd"}, None)], "is a symbolic link"),
    ([({"name": "000000000.tokens.npy.zst"}, GOOD),
      ({"name": "000000001.tokens.npy.zst", "type": b"1", "linkname": "000000000.tokens.npy.zst"}, None)], "is a hard link"),
    ([({"name": "000000000", "type": b"5"}, None)], "is a directory"),
    ([({"name": "000000000.tokens.npy.zst"}, GOOD), ({"name": "000000000.tokens.npy.zst"}, GOOD)], "appears twice"),
    ([({"name": "000000001.tokens.npy.zst"}, GOOD)], "expected sample 000000000"),
    ([({"name": "000000000.docs.npy.zst"}, zst_npy(np.zeros((1, 3), "<i8")))], "has no tokens member"),
    ([({"name": "000000000.tokens.npy.zst"}, zst_npy(np.arange(5, dtype="<u4")))], "tokens must be a 1-D"),
    ([({"name": "000000000.tokens.npy.zst"}, zst_npy(np.array([1, "x"], dtype=object), allow_pickle=True))],
     "object or Fortran-ordered arrays are not allowed"),
    ([({"name": "000000000.tokens.npy.zst"}, b"definitely not zstd")], "not a zstd frame"),
])
def test_hostile_tar_members_are_rejected(members, match):
    from shardkit.formats import decode_shard

    data = build_tar([(dict(fields), payload) for fields, payload in members])
    with pytest.raises(CorruptShardError, match=f"corrupt shard evil.tar: .*{match}"):
        decode_shard(data, shard_format="tar", token_dtype="uint16", shard="evil.tar", raw_bytes=10**6)

def test_pax_and_gnu_long_names_are_rejected():
    import io
    import tarfile

    from shardkit.formats import decode_shard

    for fmt in (tarfile.PAX_FORMAT, tarfile.GNU_FORMAT):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
            info = tarfile.TarInfo("x" * 150 + ".tokens.npy.zst")
            info.size = len(GOOD)
            tar.addfile(info, io.BytesIO(GOOD))
        with pytest.raises(CorruptShardError, match="pax header|GNU long name"):
            decode_shard(buf.getvalue(), shard_format="tar", token_dtype="uint16", shard="long.tar", raw_bytes=10**6)

def test_tar_shards_are_plain_deterministic_ustar_archives(tmp_path):
    import io
    import tarfile

    from shardkit.formats import arrays_from_samples, encode_shard
    from shardkit.formats.tar_format import _header

    for name, size in (("000000000.tokens.npy.zst", 0), ("000000007.docs.npy.zst", 4097), ("123456789.tokens.npy.zst", 8**11 - 1)):
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = size, 0o644, 0
        assert _header(name, size) == info.tobuf(format=tarfile.USTAR_FORMAT)  # what tarfile itself writes
    rng = np.random.default_rng(9)
    samples = make_samples(rng, 9, 50257)
    arrays = arrays_from_samples(samples, "uint16")
    first = encode_shard(arrays, shard_format="tar", token_dtype="uint16")
    assert encode_shard(arrays, shard_format="tar", token_dtype="uint16").sha256 == first.sha256  # deterministic
    with tarfile.open(fileobj=io.BytesIO(first.data)) as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == [f"{i:09d}.{f}.npy.zst" for i in range(9) for f in ("tokens", "docs")]
    assert all(m.isreg() and m.mtime == 0 and m.uid == 0 and m.mode == 0o644 for m in members)
    assert len(first.data) % 10240 == 0


# -- the fast encoder writes exactly the bytes of the straightforward tarfile/np.save encoder --------
def reference_encode(arrays, level):
    """Member by member with tarfile.TarInfo and numpy's write_array (the original implementation)."""
    cctx, out, raw = compressor(level), bytearray(), 0
    for i in range(arrays.num_samples):
        sample = arrays.sample(i)
        members = [("tokens", sample.tokens)]
        if sample.doc_starts is not None:
            members.append(("docs", np.stack([sample.doc_starts, sample.doc_source, sample.doc_index], axis=1)
                            .astype("<i8").reshape(-1, 3)))
        for field, array in members:
            payload = tar_format._npy_bytes(array)
            raw += len(payload)
            frame = cctx.compress(payload)
            out += tar_format._header(f"{i:09d}.{field}.npy.zst", len(frame)) + frame + b"\0" * (-len(frame) % 512)
    out += b"\0" * 1024
    out += b"\0" * (-len(out) % 10240)
    return bytes(out), raw


@pytest.mark.parametrize("token_dtype, vocab", [("uint16", 65536), ("uint32", 2**32)])
@pytest.mark.parametrize("docs", [True, False])
def test_fast_encoder_is_byte_identical(token_dtype, vocab, docs):
    rng = np.random.default_rng(7)
    samples = [Sample(np.zeros(0, dtype=np.uint32))] if not docs else []
    for i in range(120):
        n = int(rng.integers(1, 3000))
        tokens = rng.integers(0, vocab, n, dtype=np.uint64)
        if docs:
            k = min(int(rng.integers(1, 4)), n)
            starts = np.array([0, *sorted(rng.choice(np.arange(1, n), size=k - 1, replace=False))]) if n > 1 else [0]
            samples.append(Sample(tokens, starts, np.full(len(starts), i % 3 - 1), np.arange(len(starts)) + 2**40))
        else:
            samples.append(Sample(tokens))
    arrays = arrays_from_samples(samples, token_dtype)
    for level in (1, 3):
        assert tar_format.encode_tar(arrays, level=level) == reference_encode(arrays, level)
    empty = arrays_from_samples([], token_dtype)
    assert tar_format.encode_tar(empty, level=3) == reference_encode(empty, 3)
