"""Round trips of both shard formats through ShardWriter, the manifest and ShardReader."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.errors import CorruptShardError
from shardkit.formats import Sample, ShardReader, open_decoded, wds_decode_hook, write_dataset, write_decoded
from shardkit.manifest import TokenizerInfo, load_manifest
from shardkit.storage import Storage


def make_samples(rng, count, vocab, *, fixed=None, docs=True):
    samples = []
    for i in range(count):
        n = fixed if fixed is not None else int(rng.integers(0, 3000))
        tokens = rng.integers(0, vocab, n)
        if not docs:
            samples.append(Sample(tokens))
            continue
        k = min(3, n)
        starts = np.array([0, *sorted(rng.choice(np.arange(1, n), size=k - 1, replace=False))]) if k else np.zeros(0, int)
        samples.append(Sample(tokens, starts, np.full(len(starts), i % 5), np.arange(len(starts)) + i))
    return samples


@pytest.mark.parametrize("shard_format", ["tar", "arrow"])
@pytest.mark.parametrize("vocab", [50257, 200_000], ids=["uint16", "uint32"])
@pytest.mark.parametrize("docs", [True, False], ids=["docs", "nodocs"])
def test_round_trip(tmp_path, shard_format, vocab, docs):
    rng = np.random.default_rng(vocab)
    samples = make_samples(rng, 70, vocab, docs=docs)
    url = str(tmp_path / "ds")
    manifest = write_dataset(url, samples, tokenizer=TokenizerInfo(kind="byte", name="t", vocab_size=vocab),
                             seq_len=None, packing="none", shard_format=shard_format, max_samples=32)
    assert manifest.token_dtype == ("uint16" if vocab <= 65536 else "uint32")
    assert load_manifest(url) == manifest
    assert [s.samples for s in manifest.shards] == [32, 32, 6]
    storage = Storage(url)
    got = []
    for shard in manifest.shards:
        reader = ShardReader.from_bytes(storage.read_bytes(shard.name), shard=shard, manifest=manifest)
        cached = tmp_path / f"{shard.name}.decoded"
        write_decoded(str(cached), reader.arrays)
        mapped = ShardReader.open_decoded(str(cached), name=shard.name)
        got.extend(mapped.sample(i) for i in range(len(mapped)))
    assert len(got) == len(samples)
    for want, have in zip(samples, got):
        np.testing.assert_array_equal(have.tokens, want.tokens)
        assert have.has_doc_boundaries == docs
        if docs:
            np.testing.assert_array_equal(have.doc_starts, want.doc_starts)
            np.testing.assert_array_equal(have.doc_source, want.doc_source)
            np.testing.assert_array_equal(have.doc_index, want.doc_index)


def test_cached_reader_is_zero_copy_and_gathers(tmp_path):
    rng = np.random.default_rng(1)
    samples = make_samples(rng, 40, 50257, fixed=65, docs=False)
    url = str(tmp_path / "ds")
    manifest = write_dataset(url, samples, tokenizer=TokenizerInfo(kind="byte", name="t", vocab_size=50257),
                             seq_len=64, packing="concat")
    shard = manifest.shards[0]
    reader = ShardReader.from_bytes(Storage(url).read_bytes(shard.name), shard=shard, manifest=manifest)
    path = str(tmp_path / "cached")
    write_decoded(path, reader.arrays)
    mapped = ShardReader.open_decoded(path)
    assert mapped.fixed_length == 65
    view = mapped.tokens(3)
    assert isinstance(view.base, np.ndarray) or view.base is not None  # a view, not a fresh array
    assert np.shares_memory(view, open_decoded(path).tokens) is False  # separate mapping
    assert np.shares_memory(mapped.tokens(3), mapped.arrays.tokens)
    batch = mapped.gather([5, 0, 39, 5])
    np.testing.assert_array_equal(batch, np.stack([samples[i].tokens for i in (5, 0, 39, 5)]))


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


def test_pyarrow_reads_arrow_shard(tmp_path):
    import pyarrow as pa

    rng = np.random.default_rng(3)
    samples = make_samples(rng, 20, 50257)
    url = str(tmp_path / "ds")
    manifest = write_dataset(url, samples, tokenizer=TokenizerInfo(kind="byte", name="t", vocab_size=50257),
                             seq_len=None, packing="none", shard_format="arrow")
    table = pa.ipc.open_file(str(tmp_path / "ds" / manifest.shards[0].name)).read_all()
    assert table.column_names == ["tokens", "doc_starts", "doc_source", "doc_index"]
    for want, tokens in zip(samples, table.column("tokens").to_pylist()):
        assert tokens == want.tokens.tolist()


# -- edge cases: empty shards, huge samples, dtype limits ------------------------------------------

def tokenizer(vocab: int) -> TokenizerInfo:
    return TokenizerInfo(kind="byte", name="t", vocab_size=vocab)


def read_back(url, manifest, tmp_path, storage_options=None):
    """Every sample of the dataset, read through ShardReader.from_bytes and through the mmap cache."""
    storage = Storage(url, storage_options)
    direct, cached = [], []
    for shard in manifest.shards:
        reader = ShardReader.from_bytes(storage.read_bytes(shard.name), shard=shard, manifest=manifest)
        direct.extend(reader.sample(i) for i in range(len(reader)))
        path = str(tmp_path / (shard.name.replace("/", "_") + ".decoded"))
        write_decoded(path, reader.arrays)
        mapped = ShardReader.open_decoded(path, name=shard.name)
        cached.extend(mapped.sample(i) for i in range(len(mapped)))
    return direct, cached


@pytest.mark.parametrize("shard_format", ["tar", "arrow"])
@pytest.mark.parametrize("docs", [True, False], ids=["docs", "nodocs"])
def test_empty_shard_round_trips(tmp_path, shard_format, docs):
    from shardkit.formats import ShardWriter, decode_shard
    from shardkit.manifest import Manifest, write_manifest

    url = str(tmp_path / "ds")
    with ShardWriter(url, shard_format=shard_format) as writer:
        info = writer.write_empty_shard()
    assert (info.samples, info.tokens, info.raw_bytes, info.has_doc_boundaries) == (0, 0, 0, False)
    manifest = Manifest(shard_format=shard_format, token_dtype="uint16", seq_len=None, packing="none",
                        tokenizer=tokenizer(256), shards=writer.shards)
    write_manifest(writer.storage, manifest)
    direct, cached = read_back(url, load_manifest(url), tmp_path)
    assert direct == [] and cached == []
    data = Storage(url).read_bytes(info.name)
    reader = ShardReader.from_bytes(data, shard=info, manifest=manifest)
    assert len(reader) == 0 and reader.fixed_length is None
    with pytest.raises(IndexError, match="out of range for shard shard-000000"):
        reader.tokens(0)
    # An empty shard must not accept a payload that is not empty.
    with pytest.raises(CorruptShardError):
        decode_shard(data, shard_format=shard_format, token_dtype="uint16", shard=info.name, raw_bytes=1)


@pytest.mark.parametrize("shard_format", ["tar", "arrow"])
def test_dataset_without_samples_has_no_shards(tmp_path, shard_format):
    url = str(tmp_path / "ds")
    manifest = write_dataset(url, [], tokenizer=tokenizer(256), seq_len=8, packing="concat", shard_format=shard_format)
    assert manifest.shards == () and load_manifest(url).num_samples == 0


@pytest.mark.parametrize("shard_format", ["tar", "arrow"])
@pytest.mark.parametrize("vocab", [65536, 2**32], ids=["uint16", "uint32"])
def test_one_huge_sample(tmp_path, shard_format, vocab):
    rng = np.random.default_rng(11)
    n = 3_000_017  # several million tokens in one sample, an odd length
    tokens = rng.integers(0, vocab, n, dtype=np.uint64)
    tokens[:2] = [0, vocab - 1]  # both ends of the id range survive
    huge = Sample(tokens, np.array([0, 1, n - 1]), np.array([0, -1, 2]), np.array([5, 0, 2**40]))
    small = Sample(np.array([1, 2, 3]), np.array([0]), np.array([1]), np.array([7]))
    url = str(tmp_path / "ds")
    manifest = write_dataset(url, [small, huge, small], tokenizer=tokenizer(vocab), seq_len=None, packing="none",
                             shard_format=shard_format)
    assert manifest.token_dtype == ("uint16" if vocab == 65536 else "uint32")
    assert [s.samples for s in manifest.shards] == [3] and manifest.num_tokens == n + 6
    direct, cached = read_back(url, manifest, tmp_path)
    for got in (direct, cached):
        np.testing.assert_array_equal(got[1].tokens, tokens)
        assert got[1].tokens.dtype == np.dtype(manifest.token_dtype)
        np.testing.assert_array_equal(got[1].doc_index, [5, 0, 2**40])
        np.testing.assert_array_equal(got[0].tokens, [1, 2, 3])
        np.testing.assert_array_equal(got[2].doc_source, [1])


def test_token_ids_outside_the_dtype_are_rejected(tmp_path):
    from shardkit.formats import ShardWriter

    with ShardWriter(str(tmp_path / "a"), token_dtype="uint16", max_samples=1) as writer:
        with pytest.raises(ValueError, match=r"token ids must be in \[0, 65535\] for uint16"):
            writer.write(np.array([1, 65536]))
    with ShardWriter(str(tmp_path / "b"), token_dtype="uint32", max_samples=1) as writer:
        with pytest.raises(ValueError, match="token ids must be in"):
            writer.write(np.array([-1, 5]))
        with pytest.raises(TypeError, match="must be integers"):
            writer.write(np.array([1.5]))


def test_writer_rejects_bad_samples_at_once_and_keeps_going(tmp_path):
    from shardkit.formats import ShardWriter

    url = str(tmp_path / "ds")
    with ShardWriter(url, token_dtype="uint16", max_samples=2) as writer:
        writer.write(np.array([1, 2, 3]))
        with pytest.raises(ValueError, match=r"sample 1 of shard 0 \(written to .*ds\): token ids must be in"):
            writer.write(np.array([1, 70000]))
        with pytest.raises(ValueError, match="doc_starts must begin at 0"):
            writer.write(Sample(np.arange(4), np.array([1]), np.array([0]), np.array([0])))
        with pytest.raises(ValueError, match="equal length"):
            writer.write(Sample(np.arange(4), np.array([0, 2]), np.array([0]), np.array([0, 1])))
        with pytest.raises(ValueError, match="either store document boundaries or not"):
            writer.write(Sample(np.arange(4), np.array([0]), np.array([0]), np.array([0])))
        writer.write(np.array([4, 5]))
    assert [s.samples for s in writer.shards] == [2]  # the rejected samples were never buffered
    storage = Storage(url)
    from shardkit.formats import decode_shard

    arrays = decode_shard(storage.read_bytes(writer.shards[0].name), shard_format="tar", token_dtype="uint16",
                          shard="s", raw_bytes=writer.shards[0].raw_bytes)
    assert [arrays.sample(i).tokens.tolist() for i in range(2)] == [[1, 2, 3], [4, 5]]


# -- ShardWriter: rollover, hook, any fsspec URL -------------------------------------------------

def test_writer_rolls_over_by_max_samples(tmp_path):
    from shardkit.formats import ShardWriter

    with ShardWriter(str(tmp_path / "ds"), max_samples=4, max_bytes=None) as writer:
        for i in range(10):
            writer.write(np.full(7, i, dtype=np.uint16))
    assert [s.samples for s in writer.shards] == [4, 4, 2]
    assert [s.name for s in writer.shards] == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]


@pytest.mark.parametrize("shard_format", ["tar", "arrow"])
def test_writer_rolls_over_by_max_bytes(tmp_path, shard_format):
    from shardkit.formats import ShardWriter

    # 100 uint16 tokens = 200 payload bytes per sample: a shard closes once it holds >= 500 bytes.
    with ShardWriter(str(tmp_path / "ds"), shard_format=shard_format, max_bytes=500, max_samples=None,
                     name_template="part/{index:03d}", start_index=7) as writer:
        for i in range(10):
            writer.write(np.full(100, i, dtype=np.uint16))
    assert [s.samples for s in writer.shards] == [3, 3, 3, 1]
    assert writer.shards[0].name == f"part/007.{shard_format}" and writer.shards[-1].name == f"part/010.{shard_format}"
    assert Storage(str(tmp_path / "ds")).list_names() == sorted(s.name for s in writer.shards)


def test_on_shard_done_hook_sees_each_finished_shard_in_order(tmp_path):
    from shardkit.formats import ShardWriter

    storage = Storage(str(tmp_path / "ds"))
    seen = []

    def hook(info):
        # The shard is complete and readable when the hook runs.
        seen.append((info, storage.size(info.name)))

    with ShardWriter(storage, max_samples=3, on_shard_done=hook) as writer:
        for i in range(7):
            writer.write(np.arange(i, i + 5, dtype=np.uint16))
        assert len(seen) == 2  # the hook runs as shards fill, not only at the end
    assert [info for info, _ in seen] == writer.shards
    assert [size for _, size in seen] == [s.compressed_bytes for s in writer.shards]


def test_writer_does_not_publish_a_partial_shard_on_error(tmp_path):
    from shardkit.formats import ShardWriter

    url = str(tmp_path / "ds")
    with pytest.raises(RuntimeError, match="boom"):
        with ShardWriter(url, max_samples=3) as writer:
            for i in range(5):
                writer.write(np.full(4, i, dtype=np.uint16))
            raise RuntimeError("boom")
    assert Storage(url).list_names() == ["shard-000000.tar"]  # the full one only; 2 pending samples dropped


@pytest.mark.parametrize("shard_format", ["tar", "arrow"])
def test_write_dataset_to_memory_url(tmp_path, shard_format):
    import uuid

    url = f"memory://formats-{uuid.uuid4().hex[:8]}/ds"
    rng = np.random.default_rng(4)
    samples = make_samples(rng, 30, 50257, fixed=33)
    manifest = write_dataset(url, samples, tokenizer=tokenizer(50257), seq_len=32, packing="concat",
                             shard_format=shard_format, max_samples=8)
    assert load_manifest(url) == manifest
    assert [s.samples for s in manifest.shards] == [8, 8, 8, 6]
    direct, cached = read_back(url, manifest, tmp_path)
    for got in (direct, cached):
        assert len(got) == 30
        for want, have in zip(samples, got):
            np.testing.assert_array_equal(have.tokens, want.tokens)
            np.testing.assert_array_equal(have.doc_starts, want.doc_starts)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, 300), max_size=12), shard_format=st.sampled_from(["tar", "arrow"]),
       token_dtype=st.sampled_from(["uint16", "uint32"]), docs=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_encode_decode_round_trip_property(lengths, shard_format, token_dtype, docs, seed):
    from shardkit.formats import arrays_from_samples, decode_shard, encode_shard

    rng = np.random.default_rng(seed)
    top = 2**16 if token_dtype == "uint16" else 2**32
    samples = []
    for n in lengths:
        tokens = rng.integers(0, top, n, dtype=np.uint64)
        if docs:
            k = int(rng.integers(1, 4)) if n else 0
            inner = rng.integers(1, n, k) if n > 1 else np.zeros(0, int)
            starts = np.unique(np.concatenate([[0], inner]))[:k] if n else np.zeros(0, int)
            samples.append(Sample(tokens, starts, rng.integers(-1, 3, len(starts)), rng.integers(0, 10**12, len(starts))))
        else:
            samples.append(Sample(tokens))
    arrays = arrays_from_samples(samples, token_dtype)
    encoded = encode_shard(arrays, shard_format=shard_format, token_dtype=token_dtype, level=1)
    decoded = decode_shard(encoded.data, shard_format=shard_format, token_dtype=token_dtype, shard="p",
                           raw_bytes=encoded.raw_bytes)
    assert decoded.num_samples == len(samples) and encoded.tokens == sum(lengths)
    for i, want in enumerate(samples):
        have = decoded.sample(i)
        np.testing.assert_array_equal(have.tokens, want.tokens)
        if docs and len(want.tokens):
            np.testing.assert_array_equal(have.doc_starts, want.doc_starts)
            np.testing.assert_array_equal(have.doc_source, want.doc_source)
            np.testing.assert_array_equal(have.doc_index, want.doc_index)


# -- security and corruption: hostile tars, bombs, broken cache files --------------------------------

def zst_npy(array: np.ndarray, *, allow_pickle: bool = False) -> bytes:
    import io

    import zstandard

    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=allow_pickle)
    return zstandard.ZstdCompressor().compress(buf.getvalue())


def build_tar(members) -> bytes:
    """members: (TarInfo kwargs, payload or None)."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for fields, payload in members:
            info = tarfile.TarInfo(fields.pop("name"))
            for key, value in fields.items():
                setattr(info, key, value)
            if payload is not None:
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
            else:
                tar.addfile(info)
    return buf.getvalue()


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


def test_zstd_bomb_is_refused_before_allocation():
    from shardkit.formats import decode_shard

    import zstandard

    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))  # 64 MiB of zeros in a few KB
    data = build_tar([({"name": "000000000.tokens.npy.zst"}, bomb)])
    with pytest.raises(CorruptShardError, match="declares 67108864 decompressed bytes, more than the 1000 allowed"):
        decode_shard(data, shard_format="tar", token_dtype="uint16", shard="bomb.tar", raw_bytes=1000)


@pytest.mark.parametrize("shard_format", ["tar", "arrow"])
def test_raw_bytes_must_match_the_manifest_exactly(shard_format):
    from shardkit.formats import arrays_from_samples, decode_shard, encode_shard

    encoded = encode_shard(arrays_from_samples([Sample(np.arange(50))] * 3, "uint16"), shard_format=shard_format,
                           token_dtype="uint16")
    for wrong in (encoded.raw_bytes - 1, encoded.raw_bytes + 1):
        with pytest.raises(CorruptShardError, match="s.x"):
            decode_shard(encoded.data, shard_format=shard_format, token_dtype="uint16", shard="s.x", raw_bytes=wrong)


def test_arrow_with_a_foreign_schema_is_rejected():
    import pyarrow as pa

    from shardkit.formats import decode_shard

    sink = pa.BufferOutputStream()
    table = pa.table({"tokens": pa.array([[1, 2]], pa.list_(pa.int64()))})
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(CorruptShardError, match="corrupt shard f.arrow: wrong Arrow schema"):
        decode_shard(sink.getvalue().to_pybytes(), shard_format="arrow", token_dtype="uint16", shard="f.arrow",
                     raw_bytes=10**6)
    with pytest.raises(CorruptShardError, match="not a readable Arrow IPC file"):
        decode_shard(b"garbage" * 100, shard_format="arrow", token_dtype="uint16", shard="f.arrow", raw_bytes=10)


def test_broken_decoded_cache_files_are_rejected(tmp_path):
    from shardkit.formats import arrays_from_samples

    path = tmp_path / "cache.decoded"
    write_decoded(str(path), arrays_from_samples([Sample(np.arange(100))] * 4, "uint16"))
    good = path.read_bytes()
    path.write_bytes(good[: len(good) - 300])
    with pytest.raises(CorruptShardError, match="s1: .*lies outside the file"):
        open_decoded(str(path), shard="s1")
    path.write_bytes(b"NOTSHARD" + good[8:])
    with pytest.raises(CorruptShardError, match="not a shardkit decoded-shard file"):
        open_decoded(str(path), shard="s1")
    path.write_bytes(good[:10])
    with pytest.raises(CorruptShardError, match="truncated"):
        open_decoded(str(path), shard="s1")


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


def test_format_doc_snippets_read_real_shards(tmp_path):
    """docs/FORMAT.md's reader snippets (tarfile+zstandard+numpy; pyarrow alone) work on real shards."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "FORMAT.md").read_text()
    namespace: dict = {}
    for block in re.findall(r"```python\n(.*?)```", doc, flags=re.S):
        exec(compile(block, "docs/FORMAT.md", "exec"), namespace)
    rng = np.random.default_rng(12)
    samples = make_samples(rng, 25, 50257)
    for shard_format in ("tar", "arrow"):
        url = tmp_path / shard_format
        manifest = write_dataset(str(url), samples, tokenizer=tokenizer(50257), seq_len=None, packing="none",
                                 shard_format=shard_format, max_samples=10)
        got = []
        for shard in manifest.shards:
            data = (url / shard.name).read_bytes()
            if shard_format == "tar":
                got.extend(namespace["read_tar_shard"](data))
            else:
                got.extend((namespace["read_arrow_shard"](data, i), None) for i in range(shard.samples))
                assert np.array_equal(namespace["read_arrow_shard"](str(url / shard.name), 3), got[-shard.samples + 3][0])
        assert len(got) == len(samples)
        for want, (tokens, docs) in zip(samples, got):
            np.testing.assert_array_equal(tokens, want.tokens)
            if docs is not None:
                np.testing.assert_array_equal(docs, np.stack([want.doc_starts, want.doc_source, want.doc_index], axis=1))
    assert "10,240 zero bytes" in doc  # the empty-shard claim, checked here:
    from shardkit.formats import arrays_from_samples, encode_shard

    assert encode_shard(arrays_from_samples([], "uint16"), shard_format="tar", token_dtype="uint16").data == bytes(10240)


def test_gather_bounds_and_variable_length_errors(tmp_path):
    from shardkit.formats import arrays_from_samples

    path = str(tmp_path / "fixed.decoded")
    write_decoded(path, arrays_from_samples([Sample(np.arange(i, i + 6)) for i in range(5)], "uint16"))
    reader = ShardReader.open_decoded(path, name="fixed-shard")
    np.testing.assert_array_equal(reader.gather([-1, 0]), [np.arange(4, 10), np.arange(0, 6)])
    for bad in ([5], [-6], [0, 99]):
        with pytest.raises(IndexError, match=r"out of range for shard fixed-shard \(5 samples\)"):
            reader.gather(bad)
    write_decoded(path, arrays_from_samples([Sample(np.arange(3)), Sample(np.arange(4))], "uint16"))
    with pytest.raises(ValueError, match="variable-length samples; use tokens"):
        ShardReader.open_decoded(path, name="var").gather([0])
