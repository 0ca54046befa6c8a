"""Round trips of both shard formats through encode/decode, ShardWriter, the manifest and ShardReader."""

from __future__ import annotations

import numpy as np
import pytest
from format_samples import make_samples, read_back, tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.errors import CorruptShardError
from shardkit.formats import (
    Sample,
    ShardReader,
    write_dataset,
    write_decoded,
)
from shardkit.manifest import TokenizerInfo, load_manifest
from shardkit.storage import Storage


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

@pytest.mark.parametrize("shard_format", ["tar", "arrow"])
def test_raw_bytes_must_match_the_manifest_exactly(shard_format):
    from shardkit.formats import arrays_from_samples, decode_shard, encode_shard

    encoded = encode_shard(arrays_from_samples([Sample(np.arange(50))] * 3, "uint16"), shard_format=shard_format,
                           token_dtype="uint16")
    for wrong in (encoded.raw_bytes - 1, encoded.raw_bytes + 1):
        with pytest.raises(CorruptShardError, match="s.x"):
            decode_shard(encoded.data, shard_format=shard_format, token_dtype="uint16", shard="s.x", raw_bytes=wrong)


def test_an_arrow_shard_larger_than_the_room_it_was_given_is_written_again_with_the_same_bytes(monkeypatch):
    """Arrow shards are encoded into one buffer sized for them; ids that compress worse than that fit (here: a
    room too small for anything) are encoded again into a growing buffer, with the same bytes."""
    from shardkit.formats import arrays_from_samples, arrow_format, decode_shard, encode_shard

    rng = np.random.default_rng(3)
    arrays = arrays_from_samples([Sample(rng.integers(0, 65000, 3000)) for _ in range(40)], "uint16")
    roomy = encode_shard(arrays, shard_format="arrow", token_dtype="uint16", block_bytes=20_000)
    monkeypatch.setattr(arrow_format, "_FILE_SLACK", -arrays.raw_nbytes)
    cramped = encode_shard(arrays, shard_format="arrow", token_dtype="uint16", block_bytes=20_000)
    assert cramped.data == roomy.data and cramped.sha256 == roomy.sha256
    back = decode_shard(cramped.data, shard_format="arrow", token_dtype="uint16", shard="s", raw_bytes=cramped.raw_bytes)
    np.testing.assert_array_equal(back.tokens, arrays.tokens)
