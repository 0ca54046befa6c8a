"""The shard store contract (`shardkit.loaders.store.ShardStore`), one suite over every store `make_store`
resolves `cache_mode` into: what a lookup serves and counts, what a prefetch and a put keep, and who
completes a shard read block by block."""

from __future__ import annotations

import numpy as np
import pytest

from loader_helpers import ids_from_tokens, write_fixed
from shardkit.formats import decode_shard
from shardkit.loaders.cache import ShardCache, make_store
from shardkit.loaders.config import CACHE_MODES
from shardkit.manifest import load_manifest
from shardkit.storage import Storage

PER_SHARD = 20


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
