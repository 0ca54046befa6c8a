"""The first batch after `load_state_dict` costs what a fresh epoch's first batch costs (issue 36 item 2): the
resumed reader starts at the saved position at once, reading only the blocks its first batch needs, never the
epoch before it nor whole shards. Measured in the same test on the same data: the bytes and ranged reads from a
fresh cache (deterministic: prefetch off, and a shard's background completion starts only at its second read),
and the CPU time on a warm cache, with a generous margin."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from loader_helpers import ids_from_tokens, write_fixed
from shardkit import StreamingDataLoader, StreamingDataset
import shardkit.loaders.cache.shard_cache as cache_module
from shardkit.loaders.cache.store import CacheStats
from shardkit.manifest import load_manifest

BATCH = 8
OPTIONS = {"shuffle_window": 512, "seed": 5, "prefetch": False}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("first-batch") / "data")
    write_fixed(url, 4096, seq_len=256, per_shard=256)  # 16 shards of several blocks each
    return url


@pytest.fixture(scope="module")
def many_steps(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("many-steps") / "data")
    # 16384 steps of one sample: reading the half before a resumed position would show in the CPU time
    write_fixed(url, 16384, seq_len=16, per_shard=1024)
    return url


def first_batch(url: str, cache_dir: str, state: dict | None = None,
                batch_size: int = BATCH) -> tuple[float, CacheStats, dict]:
    """(CPU seconds from `load_state_dict` to the first batch, the cache's stats then, the batch)."""
    dataset = StreamingDataset(url, cache_dir=cache_dir, rank=0, world_size=1, **OPTIONS)
    loader = StreamingDataLoader(dataset, batch_size=batch_size)
    cpu = time.process_time()
    if state is not None:
        loader.load_state_dict(state)
    batches = iter(loader)
    batch = next(batches)
    cpu = time.process_time() - cpu
    stats = dataclasses.replace(dataset.caches[0].stats)  # before closing starts the shards' completion
    batches.close()
    dataset.caches[0].drain()
    return cpu, stats, batch


def mid_epoch_state(url: str, cache_dir: str, fraction: float, batch_size: int = BATCH) -> dict:
    loader = StreamingDataLoader(StreamingDataset(url, cache_dir=cache_dir, rank=0, world_size=1, **OPTIONS),
                                 batch_size=batch_size)
    state = loader.state_dict()
    return {**state, "position": {**state["position"], "samples": int(len(loader) * fraction) * batch_size}}


def test_resumed_first_batch_reads_no_more_blocks_than_a_fresh_epochs(source, tmp_path, monkeypatch):
    monkeypatch.setattr(cache_module, "WHOLE_READ_BYTES", 0)  # every shard read block by block
    _, fresh, _ = first_batch(source, str(tmp_path / "fresh"))
    assert fresh.downloads == 0 and fresh.range_reads > 0  # blocks on demand, no whole shard
    # the shards have several blocks: a batch reads less than its shards
    assert fresh.downloaded_bytes < sum(s.compressed_bytes for s in load_manifest(source).shards[:2])
    for fraction in (0.25, 0.5, 0.9):
        state = mid_epoch_state(source, str(tmp_path / "state"), fraction)
        _, resumed, batch = first_batch(source, str(tmp_path / f"resumed-{fraction}"), state)
        # the batch is the one an uninterrupted epoch reads at that position
        order = StreamingDataset(source, cache_dir=str(tmp_path / "state"), rank=0, world_size=1,
                                 **OPTIONS).source.order(0, 1)
        expected = order.sample_ids(np.arange(state["position"]["samples"], state["position"]["samples"] + BATCH))
        assert sorted(ids_from_tokens(batch["tokens"]).tolist()) == sorted(expected.tolist())
        assert resumed.downloads == 0, f"resumed at {fraction}: whole shards read before the first batch"
        assert resumed.range_reads <= 2 * fresh.range_reads, (fraction, resumed, fresh)
        assert resumed.downloaded_bytes <= 2 * fresh.downloaded_bytes, (fraction, resumed, fresh)


def test_resumed_first_batch_reads_no_more_shards_than_a_fresh_epochs(source, tmp_path):
    """Small shards are read whole: as many before the resumed first batch as before a fresh epoch's."""
    _, fresh, _ = first_batch(source, str(tmp_path / "fresh"))
    assert fresh.downloads > 0 and fresh.range_reads == 0
    for fraction in (0.25, 0.5, 0.9):
        state = mid_epoch_state(source, str(tmp_path / "state"), fraction)
        _, resumed, _ = first_batch(source, str(tmp_path / f"resumed-{fraction}"), state)
        assert resumed.downloads <= fresh.downloads, (fraction, resumed, fresh)


def test_resumed_first_batch_costs_the_cpu_of_a_fresh_epochs(many_steps, tmp_path):
    cache = str(tmp_path / "warm")
    for _ in StreamingDataLoader(StreamingDataset(many_steps, cache_dir=cache, rank=0, world_size=1, **OPTIONS),
                                 batch_size=512):
        pass  # every shard cached
    state = mid_epoch_state(many_steps, cache, 0.5, batch_size=1)
    fresh = sorted(first_batch(many_steps, cache, batch_size=1)[0] for _ in range(3))[1]
    resumed = sorted(first_batch(many_steps, cache, state, batch_size=1)[0] for _ in range(3))[1]
    # generous (CPU time, medians of 3): reading the 8192 steps before the saved position would not pass it
    assert resumed <= 3 * fresh + 0.008, (resumed, fresh)
