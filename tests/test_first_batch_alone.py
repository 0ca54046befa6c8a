"""An iteration's first batch has the link to itself (issue 47, item 3): the shards of the chunk after the first are
prefetched once the first batch is out, not while it is read."""

from __future__ import annotations

import time

from loader_helpers import write_fixed

from shardkit import StreamingDataLoader, StreamingDataset


def test_the_next_chunks_shards_are_prefetched_after_the_first_batch(tmp_path):
    url = str(tmp_path / "data")
    write_fixed(url, 128, per_shard=16)  # 8 shards of 16 samples
    dataset = StreamingDataset(url, cache_dir=str(tmp_path / "cache"), shuffle=False, rank=0, world_size=1,
                               chunk_samples=32, prefetch=True)
    cache = dataset.caches[0]
    batches = iter(StreamingDataLoader(dataset, batch_size=8))
    assert next(batches)["sample_id"].tolist() == list(range(8))  # the first chunk: shards 0 and 1
    time.sleep(0.5)  # time enough for a prefetch of two small local shards
    assert not cache.is_cached(2) and not cache.is_cached(3), "the next chunk was prefetched during the first batch"
    next(batches)
    deadline = time.monotonic() + 30
    while not (cache.is_cached(2) and cache.is_cached(3)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cache.is_cached(2) and cache.is_cached(3), "the next chunk was never prefetched"
    ids = [i for batch in batches for i in batch["sample_id"].tolist()]
    assert ids == list(range(16, 128))
