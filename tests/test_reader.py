"""ShardReader: zero-copy reads of decoded files, gathers and their bounds."""

from __future__ import annotations

import numpy as np
import pytest
from format_samples import make_samples

from shardkit.formats import (
    Sample,
    ShardReader,
    open_decoded,
    write_dataset,
    write_decoded,
)
from shardkit.manifest import TokenizerInfo
from shardkit.storage import Storage


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
