"""The tar shard format, both layouts (a member group per block, a member per sample): WebDataset interop,
hostile archives, deterministic bytes, the fast encoder, size against Arrow on real tokens."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import shared_path
from format_samples import build_tar, make_samples, zst_npy

from shardkit.errors import CorruptShardError
from shardkit.formats import (
    Sample,
    arrays_from_samples,
    decode_shard,
    encode_shard,
    tar_format,
    wds_decode_hook,
    wds_samples,
    write_dataset,
)
from shardkit.formats.blocks import BlockIndex
from shardkit.formats.shard_bytes import decode_block
from shardkit.formats.zstd_frames import compressor
from shardkit.manifest import TokenizerInfo


@pytest.mark.parametrize("tar_layout", ["blocks", "samples"])
def test_webdataset_reads_tar_shard(tmp_path, tar_layout):
    wds = pytest.importorskip("webdataset")
    rng = np.random.default_rng(2)
    samples = make_samples(rng, 12, 50257)
    url = str(tmp_path / "ds")
    manifest = write_dataset(url, samples, tokenizer=TokenizerInfo(kind="byte", name="t", vocab_size=50257),
                             seq_len=None, packing="none", tar_layout=tar_layout, block_bytes=8192)
    path = str(tmp_path / "ds" / manifest.shards[0].name)
    records = list(wds.WebDataset(path, shardshuffle=False).decode(wds_decode_hook))
    # One webdataset record per group of samples (~8 KB of tokens each here), or per sample.
    assert 1 < len(records) < len(samples) if tar_layout == "blocks" else len(records) == len(samples)
    split = list(wds.WebDataset(path, shardshuffle=False).decode(wds_decode_hook).compose(wds_samples))
    assert [record["__key__"] for record in split] == [f"{i:09d}" for i in range(len(samples))]
    for want, record in zip(samples, split):
        np.testing.assert_array_equal(record["tokens.npy.zst"], want.tokens)
        np.testing.assert_array_equal(record["docs.npy.zst"][:, 0], want.doc_starts)
        np.testing.assert_array_equal(record["docs.npy.zst"][:, 2], want.doc_index)


@pytest.mark.parametrize(("writer_options", "layout", "version"), [
    ({}, "blocks", 3),  # the default: group layout, which readers of manifest version 2 do not parse
    ({"tar_layout": "samples"}, "samples", 2),  # still read by shardkit from before the group layout
    ({"format_version": 1}, "samples", 1),  # version 1 is what the oldest readers read: per-sample layout
])
def test_the_manifest_declares_the_tar_layout_by_its_version(tmp_path, writer_options, layout, version):
    import tarfile

    from shardkit.manifest import load_manifest

    url = tmp_path / "ds"
    samples = make_samples(np.random.default_rng(3), 30, 50257)
    written = write_dataset(str(url), samples, tokenizer=TokenizerInfo(kind="byte", name="t", vocab_size=50257),
                            seq_len=None, packing="none", block_bytes=4096, **writer_options)
    loaded = load_manifest(str(url))
    assert written.format_version == loaded.format_version == version
    with tarfile.open(url / loaded.shards[0].name) as tar:
        first = tar.getmembers()[0].name
    assert first.endswith(".sample_offsets.npy.zst" if layout == "blocks" else ".tokens.npy.zst")
    arrays = decode_shard((url / loaded.shards[0].name).read_bytes(), shard_format="tar", token_dtype="uint16",
                          shard=loaded.shards[0].name, raw_bytes=loaded.shards[0].raw_bytes)
    np.testing.assert_array_equal(arrays.tokens, np.concatenate([s.tokens for s in samples]))


def test_the_group_layout_without_block_indexes_is_refused():
    """Version 1 manifests are what the oldest readers read; group layout shards under one would look corrupt."""
    from shardkit.formats import ShardWriter

    with pytest.raises(ValueError, match="tar_layout 'blocks' needs format_version 2"):
        ShardWriter("memory://refused", format_version=1, tar_layout="blocks")
    with pytest.raises(ValueError, match="tar_layout must be one of"):
        encode_shard(arrays_from_samples(make_samples(np.random.default_rng(1), 2, 50257), "uint16"),
                     shard_format="tar", token_dtype="uint16", tar_layout="rows")


def test_both_layouts_decode_to_the_same_arrays_block_by_block_and_whole():
    for docs in (True, False):
        arrays = arrays_from_samples(make_samples(np.random.default_rng(4), 40, 50257, docs=docs), "uint16")
        for layout in ("blocks", "samples"):
            shard = encode_shard(arrays, shard_format="tar", token_dtype="uint16", block_bytes=16384, tar_layout=layout)
            whole = decode_shard(shard.data, shard_format="tar", token_dtype="uint16", shard="s.tar",
                                 raw_bytes=shard.raw_bytes)
            index = BlockIndex.from_bytes(shard.data[shard.index_offset:shard.index_offset + shard.index_bytes],
                                          shard="s.tar", samples=shard.samples, tokens=shard.tokens,
                                          raw_bytes=shard.raw_bytes, index_offset=shard.index_offset)
            assert len(index.blocks) > 2
            parts = [decode_block(shard.data[b.byte_start:b.byte_end], b, number=n, shard_format="tar",
                                  token_dtype="uint16", has_docs=docs, shard="s.tar")
                     for n, b in enumerate(index.blocks)]
            for field in ("tokens", "sample_offsets", "doc_offsets", "doc_starts", "doc_source", "doc_index"):
                want = getattr(arrays, field)
                if want is None:
                    assert getattr(whole, field) is None
                    continue
                np.testing.assert_array_equal(getattr(whole, field), want)
                if field in ("tokens", "doc_starts", "doc_source", "doc_index"):
                    np.testing.assert_array_equal(np.concatenate([getattr(p, field) for p in parts]), want)

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
    data = build_tar([(dict(fields), payload) for fields, payload in members])
    with pytest.raises(CorruptShardError, match=f"corrupt shard evil.tar: .*{match}"):
        decode_shard(data, shard_format="tar", token_dtype="uint16", shard="evil.tar", raw_bytes=10**6)


def group(key, offsets, tokens, *extra):
    """A group layout group's members: offsets, tokens (uint16) and optional (field, array) pairs."""
    def array(values, dtype):  # an ndarray is stored as it is, to test wrong dtypes
        return values if isinstance(values, np.ndarray) else np.asarray(list(values), dtype=dtype)

    members = [({"name": f"{key:09d}.sample_offsets.npy.zst"}, zst_npy(array(offsets, "<i8"))),
               ({"name": f"{key:09d}.tokens.npy.zst"}, zst_npy(array(tokens, "<u2")))]
    return members + [({"name": f"{key:09d}.{field}.npy.zst"}, zst_npy(array)) for field, array in extra]


DOCS = [("doc_offsets", np.array([0, 1], "<i8")), ("docs", np.zeros((1, 3), "<i8"))]


@pytest.mark.parametrize(("members", "match"), [
    ([({"name": "../000000000.sample_offsets.npy.zst"}, zst_npy(np.array([0, 1], "<i8")))], "unexpected tar member"),
    (group(0, [1, 5], range(5)), "offsets must rise from 0 to 5"),
    (group(0, [0, 6], range(5)), "offsets must rise from 0 to 5"),
    (group(0, [0, 4, 3, 5], range(5)), "offsets must rise from 0 to 5"),
    (group(0, [0], []), "at least 2 offsets"),
    (group(0, np.array([0.0, 5.0]), range(5)), "must be a 1-D int64 array"),
    (group(1, [0, 5], range(5)), "expected the group of sample 000000000"),
    (group(0, [0, 5], range(5)) + group(2, [0, 5], range(5)), "expected the group of sample 000000001"),
    (group(0, [0, 5], range(5))[:1] + group(1, [0, 5], range(5)), "group 000000000 has members sample_offsets;"),
    (group(0, [0, 5], range(5))[::-1], "a group layout member in a per-sample layout shard"),
    (group(0, [0, 5], range(5), *DOCS) + group(1, [0, 5], range(5)), "group 000000001 has members"),
    (group(0, [0, 5], range(5), *DOCS[::-1]), "group 000000000 has members"),
    (group(0, [0, 5], range(5), ("doc_offsets", np.array([0, 0, 1], "<i8")), DOCS[1]),
     "doc_offsets.npy.zst: 2 samples, its sample_offsets say 1"),
    (group(0, [0, 5], range(5), DOCS[0], ("docs", np.zeros((1, 2), "<i8"))), "docs must be an int64 \\(k, 3\\)"),
    (group(0, [0, 5], np.arange(5) + 0.5), "tokens must be a 1-D uint16"),
    ([({"name": "000000000.sample_offsets.npy.zst"}, zst_npy(np.array([0, 1], "<i8"))),
      ({"name": "000000000.tokens.npy.zst"}, zst_npy(np.zeros(10**6, "<u2")))], "declares 2000128 decompressed bytes"),
])
def test_hostile_group_layout_members_are_rejected(members, match):
    data = build_tar([(dict(fields), payload) for fields, payload in members])
    with pytest.raises(CorruptShardError, match=f"corrupt shard evil.tar: .*{match}"):
        decode_shard(data, shard_format="tar", token_dtype="uint16", shard="evil.tar", raw_bytes=10**6)


def test_a_cut_or_padded_block_is_refused_naming_the_shard():
    """A block is decoded from its own bytes, without an end-of-archive marker: bytes missing at its end, or a
    zero block in place of a member, never pass as a shorter block."""
    arrays = arrays_from_samples(make_samples(np.random.default_rng(5), 30, 50257), "uint16")
    shard = encode_shard(arrays, shard_format="tar", token_dtype="uint16", block_bytes=16384)
    index = BlockIndex.from_bytes(shard.data[shard.index_offset:shard.index_offset + shard.index_bytes], shard="s.tar",
                                  samples=shard.samples, tokens=shard.tokens, raw_bytes=shard.raw_bytes,
                                  index_offset=shard.index_offset)
    block = index.blocks[1]
    data = shard.data[block.byte_start:block.byte_end]
    for broken, match in ((data[:-512], "claims .* bytes but the shard ends first"),
                          (bytes(512) + data, "payload is 0 bytes")):
        with pytest.raises(CorruptShardError, match=f"corrupt shard s.tar: .*{match}"):
            decode_block(broken, block, number=1, shard_format="tar", token_dtype="uint16", has_docs=True, shard="s.tar")


def test_pax_and_gnu_long_names_are_rejected():
    import io
    import tarfile

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

    from shardkit.formats.tar_format import _header

    for name, size in (("000000000.tokens.npy.zst", 0), ("000000007.docs.npy.zst", 4097), ("123456789.tokens.npy.zst", 8**11 - 1)):
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = size, 0o644, 0
        assert _header(name, size) == info.tobuf(format=tarfile.USTAR_FORMAT)  # what tarfile itself writes
    rng = np.random.default_rng(9)
    samples = make_samples(rng, 9, 50257, fixed=100)
    arrays = arrays_from_samples(samples, "uint16")
    group_fields = ("sample_offsets", "tokens", "doc_offsets", "docs")
    for layout, names in (("samples", [f"{i:09d}.{f}.npy.zst" for i in range(9) for f in ("tokens", "docs")]),
                          ("blocks", [f"{i:09d}.{f}.npy.zst" for i in (0, 3, 6) for f in group_fields])):
        per_group = 3 * (100 * 2 + 8 + 8 + 3 * 24)  # 3 samples: tokens, two offsets, 3 segments of 24 bytes
        first = encode_shard(arrays, shard_format="tar", token_dtype="uint16", tar_layout=layout, block_bytes=per_group)
        again = encode_shard(arrays, shard_format="tar", token_dtype="uint16", tar_layout=layout, block_bytes=per_group)
        assert again.sha256 == first.sha256  # deterministic
        with tarfile.open(fileobj=io.BytesIO(first.data)) as tar:
            members = tar.getmembers()
        assert [m.name for m in members] == names, layout
        assert all(m.isreg() and m.mtime == 0 and m.uid == 0 and m.mode == 0o644 for m in members)
        assert len(first.data) % 10240 == 0


@pytest.mark.shared
def test_real_tokens_group_layout_is_within_10_percent_of_arrow(tmp_path):
    """GPT-2 tokens of real text, seq-len 1024, document boundaries: the tar shard of the group layout stays
    within 10% of the Arrow shard of the same samples (a member per sample made it about 3x)."""
    import json

    import zstandard

    from shardkit.text.tokenizers import load_tokenizer

    corpus = shared_path("corpora/mix.jsonl.zst")
    tokenizer = load_tokenizer(str(shared_path("tokenizers/r50k_base.tiktoken")))
    with zstandard.ZstdDecompressor().stream_reader(open(corpus, "rb")) as reader:
        lines = reader.read(2_000_000).decode("utf-8", "ignore").splitlines()[:-1]
    stream, starts, index = [], [], []
    for number, line in enumerate(lines):
        starts.append(len(stream))
        index.append(number)
        stream.extend(tokenizer.encode(json.loads(line)["text"]).tolist() + [50256])
    stream, starts = np.array(stream), np.array(starts)
    samples = []
    for begin in range(0, len(stream) - 1025, 1025):  # concat packing: windows of 1,025 tokens
        inside = np.flatnonzero((starts > begin) & (starts < begin + 1025))
        first = np.searchsorted(starts, begin, side="right") - 1
        docs = np.concatenate([[first], inside])
        samples.append(Sample(stream[begin:begin + 1025], np.maximum(starts[docs] - begin, 0), np.zeros(len(docs), int),
                              np.array(index)[docs]))
    arrays = arrays_from_samples(samples, "uint16")
    arrow = len(encode_shard(arrays, shard_format="arrow", token_dtype="uint16").data)
    tar = len(encode_shard(arrays, shard_format="tar", token_dtype="uint16").data)  # the default layout
    per_sample = len(encode_shard(arrays, shard_format="tar", token_dtype="uint16", tar_layout="samples").data)
    assert tar <= 1.10 * arrow, (tar, arrow)
    assert per_sample > 2 * arrow, (per_sample, arrow)  # what the group layout fixes


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
