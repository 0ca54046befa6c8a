"""Round trips of both shard formats through ShardWriter, the manifest and ShardReader."""

from __future__ import annotations

import numpy as np
import pytest

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
