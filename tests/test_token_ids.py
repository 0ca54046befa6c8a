"""Token ids outside the tokenizer's vocabulary are refused when a shard is decoded (issue 10, item 2).

The shard below has hashes and totals that agree with its manifest: only its contents are wrong, as
after a build with the wrong tokenizer. The loader must stop at the shard, naming it and the sample,
instead of handing the ids to an embedding table (a device-side assert far from the cause on a GPU).
"""

from __future__ import annotations

import numpy as np
import pytest

from shardkit.errors import CorruptShardError
from shardkit.formats import Sample, ShardReader, write_dataset
from shardkit.manifest import TokenizerInfo, load_manifest
from shardkit.storage import Storage

VOCAB = 100
SEQ = 16


def write(tmp_path, bad_sample: int | None):
    rng = np.random.default_rng(0)
    samples = []
    for i in range(40):
        tokens = rng.integers(0, VOCAB, SEQ + 1)
        if i == bad_sample:
            tokens[5] = VOCAB + 7  # fits the uint16 dtype, outside the vocabulary
        samples.append(Sample(tokens))
    url = str(tmp_path / "ds")
    write_dataset(url, iter(samples), seq_len=SEQ, packing="concat",
                  tokenizer=TokenizerInfo(kind="byte", name="t", vocab_size=VOCAB), max_samples=10)
    return url


def test_the_loader_refuses_an_id_outside_the_vocabulary_naming_shard_and_sample(tmp_path):
    from shardkit.loaders.dataset import StreamingDataset

    url = write(tmp_path, bad_sample=23)
    dataset = StreamingDataset(url, cache_dir=str(tmp_path / "cache"), shuffle=False, rank=0, world_size=1,
                               batch_size=4)
    with pytest.raises(CorruptShardError, match=r"sample 3 holds token id 107, outside the tokenizer's vocabulary "
                                                r"of 100 ids") as caught:
        for _ in dataset:
            pass
    assert load_manifest(url).shards[2].name in str(caught.value)


def test_a_clean_dataset_passes_and_the_direct_reader_checks_too(tmp_path):
    from shardkit.loaders.dataset import StreamingDataset

    clean = write(tmp_path / "clean", bad_sample=None)
    dataset = StreamingDataset(clean, cache_dir=str(tmp_path / "cache"), shuffle=False, rank=0, world_size=1,
                               batch_size=4)
    assert sum(len(batch["sample_id"]) for batch in dataset) == 40
    bad = write(tmp_path / "bad", bad_sample=0)
    manifest = load_manifest(bad)
    data = Storage(bad).read_bytes(manifest.shards[0].name)
    with pytest.raises(CorruptShardError, match="sample 0 holds token id 107"):
        ShardReader.from_bytes(data, shard=manifest.shards[0], manifest=manifest)
