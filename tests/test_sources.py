"""`loaders/sources/built/streams.py`: a StreamingDataset's streams opened once, and the options checked against the data they
read (each refusal names the option or both streams, before any cache is made); shard questions answered
without the dataset."""

from __future__ import annotations

import os

import pytest

from loader_helpers import fixed_sample, write_fixed
from shardkit import Schedule, Stream, StreamingDataset
from shardkit.formats import write_dataset
from shardkit.manifest import TokenizerInfo


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    out = {name: str(root / name) for name in ("a", "b", "long", "other_tokenizer")}
    write_fixed(out["a"], 64, seq_len=8, per_shard=32)
    write_fixed(out["b"], 32, seq_len=8, per_shard=16, offset=64)
    write_fixed(out["long"], 32, seq_len=16, per_shard=16)
    write_dataset(out["other_tokenizer"], (fixed_sample(i, 9) for i in range(32)),
                  tokenizer=TokenizerInfo(kind="byte", name="other", vocab_size=1000), seq_len=8, packing="concat",
                  max_samples=16)
    out["cache"] = str(root / "cache")
    return out


@pytest.mark.parametrize(("source", "options", "message"), [
    ("a", {"epoch_size": 10}, "epoch_size applies to mixtures of several Streams only"),
    ("ab", {"skip_samples": "3"}, "skip_samples applies to a single dataset, not a mixture of 2 Streams"),
    ("a", {"max_tokens": 5}, r"max_tokens=5 is below the longest sample the manifests allow \(max_sample_tokens=9\)"),
    ("schedule", {"max_tokens": 64}, "weight Schedules need fixed-size batches"),
    ("a+long", {}, r"/long: sample_length=17 differs from .*/a \(9\); streams of a mixture must agree"),
    ("a+other_tokenizer", {}, r"uses tokenizer other \(1000 ids\), .*/a uses test"),
])
def test_options_that_do_not_fit_the_data_are_refused_naming_them(urls, source, options, message):
    streams = {"ab": [Stream(urls["a"]), Stream(urls["b"])],
               "schedule": [Stream(urls["a"], weight=Schedule([(0, 1.0), (5, 2.0)])), Stream(urls["b"])],
               "a+long": [Stream(urls["a"]), Stream(urls["long"])],
               "a+other_tokenizer": [Stream(urls["a"]), Stream(urls["other_tokenizer"])]}.get(source, urls.get(source))
    cache = os.path.join(urls["cache"], source)
    with pytest.raises(ValueError, match=message):
        StreamingDataset(streams, cache_dir=cache, **options)
    # Refused before the shard caches are made: nothing of the dataset's shards in the cache directory.
    assert not any("shard-" in name for _, _, names in os.walk(cache) for name in names)


def test_a_source_that_is_no_url_or_streams_is_a_type_error(urls):
    for source in (3, [], [urls["a"]], None):
        with pytest.raises(TypeError, match="source must be a dataset URL"):
            StreamingDataset(source, cache_dir=urls["cache"])


def test_shards_are_described_and_verified_without_the_dataset(urls, tmp_path):
    dataset = StreamingDataset([Stream(urls["a"]), Stream(urls["b"])], cache_dir=str(tmp_path / "cache"))
    sources = dataset.sources
    assert [sources.owners[i] for i in range(len(sources.owners))] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    url, samples, stream_url = sources.describe_shard(3)
    assert (samples, stream_url) == (16, urls["b"]) and url.endswith(dataset.manifests[1].shards[1].name)
    assert sources.verify_shard(2) is None and dataset.caches[1].is_cached(0)  # fetched (verified) into the cache
    name = dataset.manifests[0].shards[1].name
    path = os.path.join(urls["a"], name)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x40
    copy = tmp_path / "damaged"
    write_fixed(str(copy), 64, seq_len=8, per_shard=32)
    (copy / name).write_bytes(bytes(data))
    damaged = StreamingDataset(str(copy), cache_dir=str(tmp_path / "cache2")).sources
    assert damaged.verify_shard(0) is None
    assert "sha256" in damaged.verify_shard(1).lower()
