"""The shard store contract (`shardkit.loaders.cache.store.ShardStore`), one suite over every store `make_store`
resolves `cache_mode` into: what a lookup serves and counts, what a prefetch and a put keep, and who
completes a shard read block by block."""

from __future__ import annotations

import numpy as np
import pytest

from loader_helpers import VOCAB, fixed_sample, ids_from_tokens, write_fixed
from shardkit.formats import decode_shard, write_dataset
import shardkit.loaders.cache.shard_cache as cache_module
from shardkit.loaders.cache.shard_cache import ShardCache, make_store
from shardkit.loaders.config import CACHE_MODES
from shardkit.manifest import TokenizerInfo, load_manifest
from shardkit.storage import Storage

PER_SHARD = 20
BLOCK_SAMPLES = 240  # one format v2 shard of many 2 KiB blocks


@pytest.fixture
def dataset(tmp_path):
    url = str(tmp_path / "ds")
    write_fixed(url, 3 * PER_SHARD, per_shard=PER_SHARD)
    return url


def served_ids(handle) -> list[int]:
    reader = handle.reader
    return ids_from_tokens(reader.gather(np.arange(len(reader)))).tolist()


@pytest.mark.parametrize("mode", CACHE_MODES)
def test_every_store_keeps_the_contract(dataset, tmp_path, mode):
    storage = Storage(dataset)
    manifest = load_manifest(storage)
    cache = ShardCache(storage, manifest, str(tmp_path / "cache"), cache_mode=mode)
    store, stats = cache.store, cache.stats
    keeps = mode != "none"

    # lookup: the verified shard, fetched once on a miss; then kept or not, as the mode says
    assert not store.contains(0)
    handle = store.lookup(0)
    assert served_ids(handle) == list(range(PER_SHARD))
    handle.close()
    assert store.contains(0) is keeps and cache.is_cached(0) is keeps
    assert (stats.downloads, stats.hits) == (1, 0)
    handle = store.lookup(0)
    assert served_ids(handle) == list(range(PER_SHARD))
    handle.close()
    assert (stats.downloads, stats.hits) == ((1, 1) if keeps else (2, 0))

    # prefetch: a store that keeps shards fetches it now, and the reader finds it
    downloads = stats.downloads
    assert store.prefetch(1) is keeps and store.contains(1) is keeps
    assert stats.downloads == downloads + keeps
    handle = store.lookup(1)
    assert served_ids(handle) == list(range(PER_SHARD, 2 * PER_SHARD))
    handle.close()
    assert stats.downloads == downloads + 1

    # claim: the node's stores let one process complete a shard (a second claim waits its turn);
    # "none" has no shared copy, so every reader completes its own
    first = store.claim(2)
    assert first is not None
    second = store.claim(2)
    assert (second is None) is keeps
    if second is not None:
        second()
    # put: a shard completed block by block (arrays, and its file when the store keeps bytes) is kept
    data = storage.read_bytes(manifest.shards[2].name)
    arrays = decode_shard(data, shard_format=manifest.shard_format, token_dtype=manifest.token_dtype,
                          shard=manifest.shards[2].name, raw_bytes=manifest.shards[2].raw_bytes)
    store.put(2, arrays, data if store.keeps_bytes else None)
    first()
    assert store.contains(2) is keeps
    downloads = stats.downloads
    handle = store.lookup(2)
    assert served_ids(handle) == list(range(2 * PER_SHARD, 3 * PER_SHARD))
    handle.close()
    assert stats.downloads == downloads + (not keeps)


def test_the_factory_is_the_one_place_that_reads_the_mode(dataset, tmp_path):
    cache = ShardCache(Storage(dataset), load_manifest(dataset), str(tmp_path / "cache"))
    kinds = {mode: type(make_store(mode, cache._context)).__name__ for mode in CACHE_MODES}
    assert len(set(kinds.values())) == len(CACHE_MODES), kinds
    with pytest.raises(ValueError, match="cache_mode must be one of decoded, compressed, none, got 'fast'"):
        make_store("fast", cache._context)
    with pytest.raises(ValueError, match="cache_mode must be one of"):
        ShardCache(Storage(dataset), load_manifest(dataset), str(tmp_path / "other"), cache_mode="fast")
    assert not (tmp_path / "other").exists()  # refused before any directory is made


@pytest.fixture
def block_dataset(tmp_path, monkeypatch):
    """One format v2 shard of many blocks, read block by block however small (the real threshold is 2 MiB)."""
    monkeypatch.setattr(cache_module, "WHOLE_READ_BYTES", 0)
    url = str(tmp_path / "blocks")
    write_dataset(url, (fixed_sample(i, 65) for i in range(BLOCK_SAMPLES)),
                  tokenizer=TokenizerInfo(kind="byte", name="test", vocab_size=VOCAB), seq_len=64, packing="concat",
                  shard_format="tar", max_samples=BLOCK_SAMPLES, format_version=2, block_bytes=2048)
    return url


@pytest.mark.parametrize("mode", CACHE_MODES)
def test_a_shard_read_block_by_block_is_completed_once_per_node_and_adopted(block_dataset, tmp_path, mode):
    """Two caches of one node directory (two processes, as flock sees it): the first to open the shard
    completes it, and a reader that lets go early still has it finished and stored; the other reads blocks
    until the stored copy exists, then adopts it. With "none" every reader streams its own and an abandoned
    completion stops."""
    keeps = mode != "none"
    manifest = load_manifest(block_dataset)
    first, second = (ShardCache(Storage(block_dataset), manifest, str(tmp_path / "node"), cache_mode=mode)
                     for _ in range(2))
    completing = first.open(0, on_demand=True)
    reading = second.open(0, on_demand=True)
    try:
        assert not completing.complete and not reading.complete
        assert first.prefetch(0) is False  # this process completes it already: no whole read beside it
        completing.ensure([0])
        partial = completing.partial
        completing.close()  # let go after one block: stored all the same, or stopped
        first.drain(30)
        assert partial.wait_complete(30) is keeps and first.is_cached(0) is keeps
        assert first.stats.downloads == keeps

        reads = second.stats.range_reads
        reading.ensure([0, BLOCK_SAMPLES - 1])
        adopted = reading.partial is None
        assert adopted is keeps
        assert (second.stats.range_reads == reads) is keeps  # adopted: no block read for it
        tokens = reading.reader.gather(np.array([0, BLOCK_SAMPLES - 1]))
        assert ids_from_tokens(tokens).tolist() == [0, BLOCK_SAMPLES - 1]
    finally:  # a failed check leaves no completion running behind the next test
        completing.close()
        reading.close()
        first.drain(30)
        second.drain(30)
