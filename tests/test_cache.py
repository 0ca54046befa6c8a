"""The node-local cache: one download per shard per node (counted at a real S3 endpoint), hash
checks, LRU eviction order, the limit held at its peak by 8 concurrent processes, and SIGKILL during a
download."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time

import numpy as np
import pytest

from conftest import S3_TEST_CREDENTIALS, free_port
from loader_helpers import ids_from_tokens, lock_is_held, write_fixed
from loader_procs import loader_run, open_shards
from s3_proxy import CountingProxy
from shardkit.errors import CorruptShardError
from shardkit.formats import SHARD_READS
from shardkit.loaders.cache.shard_cache import CacheLimitError, ShardCache
from shardkit.loaders.cache.decoded_store import decoded_size
from shardkit.manifest import load_manifest
from shardkit.storage import Storage


@pytest.fixture
def proxied_bucket(s3_bucket, s3_endpoint):
    """A fresh bucket and storage_options that go through a GET-counting proxy."""
    url, options = s3_bucket
    proxy = CountingProxy(s3_endpoint)
    try:
        yield url, options, {**options, "endpoint_url": proxy.url}, proxy
    finally:
        proxy.close()


def decoded_file_size(tmp_path, url) -> int:
    """Size of shard 0's decoded file (decoded once in a scratch cache)."""
    cache = ShardCache(Storage(url), load_manifest(url), str(tmp_path / "scratch"))
    cache.open(0).close()
    return os.path.getsize(cache.path(0))


def shard_room(tmp_path, url) -> int:
    """Bytes of room shard 0 needs under cache_limit (`decoded_size`: an upper bound of its decoded file)."""
    handle = ShardCache(Storage(url), load_manifest(url), str(tmp_path / "scratch")).open(0)
    try:
        return decoded_size(handle.reader.arrays)
    finally:
        handle.close()


def local_cache(tmp_path, url, **kwargs):
    storage = Storage(url)
    return ShardCache(storage, load_manifest(storage), str(tmp_path / "cache"), **kwargs)


@pytest.mark.slow
@pytest.mark.s3
def test_each_shard_downloaded_once_per_node(process_pool, proxied_bucket, tmp_path):
    url, direct, proxied, proxy = proxied_bucket
    manifest = write_fixed(url, 300, per_shard=25, storage_options=direct)
    port = free_port()
    # 2 ranks x 2 DataLoader workers, one node, one shared cache directory
    results = process_pool.run(loader_run, [dict(url=url, cache_dir=str(tmp_path / "node"), batch_size=4, rank=r,
                                                 world_size=2, port=port, num_workers=2, env=S3_TEST_CREDENTIALS,
                                                 storage_options=proxied, dataset_kwargs={"shuffle_window": 30})
                                            for r in range(2)])
    assert all(r["mismatched"] == 0 for r in results)
    gets = proxy.gets(".tar")
    assert len(gets) == len(manifest.shards)
    assert set(gets.values()) == {1}, f"downloads per shard: {gets}"


@pytest.mark.s3
def test_corrupt_shard_is_downloaded_twice_then_named(proxied_bucket, tmp_path):
    url, direct, proxied, proxy = proxied_bucket
    manifest = write_fixed(url, 60, per_shard=30, storage_options=direct)
    bad = manifest.shards[1].name
    storage = Storage(url, direct)
    data = bytearray(storage.read_bytes(bad))
    data[len(data) // 2] ^= 0xFF
    storage.write_bytes(bad, bytes(data))
    cache = ShardCache(Storage(url, proxied), manifest, str(tmp_path / "cache"))
    cache.open(0).close()
    with pytest.raises(CorruptShardError, match=f"{url}/{bad}: .* on each of {SHARD_READS} reads"):
        cache.open(1)
    assert SHARD_READS == 2 and proxy.gets(bad) == {f"/{url[5:]}/{bad}": SHARD_READS}
    assert not cache.is_cached(1)


def test_cache_files_stay_inside_and_reuse_across_instances(tmp_path):
    url = str(tmp_path / "ds")
    write_fixed(url, 90, per_shard=30)
    cache = local_cache(tmp_path, url)
    for i in range(3):
        handle = cache.open(i)
        assert handle.reader.num_samples == 30
        handle.close()
    assert cache.stats.downloads == 3
    assert all(cache.path(i).startswith(cache.directory + os.sep) for i in range(3))
    again = local_cache(tmp_path, url)
    again.open(2).close()
    assert again.stats.downloads == 0 and again.stats.hits == 1


def test_limit_smaller_than_the_working_set_says_so(tmp_path):
    url = str(tmp_path / "ds")
    write_fixed(url, 90, per_shard=30)
    size = decoded_file_size(tmp_path, url)
    with pytest.raises(CacheLimitError, match="smaller than one decoded shard"):
        local_cache(tmp_path, url, cache_limit=size // 2).open(0)
    cache = local_cache(tmp_path, url, cache_limit=int(size * 2.5), wait_timeout=1.0)
    held = [cache.open(0), cache.open(1)]
    with pytest.raises(CacheLimitError, match="cannot hold the working set"):
        cache.open(2)
    held[0].close()
    cache.open(2).close()  # room once a reader lets go: the LRU unheld shard is evicted
    assert cache.stats.evictions == 1 and not cache.is_cached(0)
    held[1].close()


def test_the_limit_is_exact_at_its_boundary_and_counts_the_bytes_this_process_holds(tmp_path):
    """A shard needs `decoded_size` bytes of room (an upper bound of its file); a limit of exactly that
    holds it, and exactly one more file's bytes hold two without evicting; one byte less evicts. Bytes
    this process holds are counted while held, and released when closed."""
    url = str(tmp_path / "ds")
    write_fixed(url, 90, per_shard=30)
    need = shard_room(tmp_path, url)
    size = decoded_file_size(tmp_path, url)  # every shard holds 30 samples of the same length
    assert size <= need < size + 1024 + 6 * 64

    only_one = local_cache(tmp_path, url, cache_limit=need, wait_timeout=0.5)
    only_one.open(0).close()
    assert only_one.is_cached(0)
    only_one.open(1).close()  # shard 0 (not held) makes room
    assert [only_one.is_cached(i) for i in range(2)] == [False, True] and only_one.stats.evictions == 1

    for limit, kept in ((size + need, True), (size + need - 1, False)):
        cache = ShardCache(Storage(url), load_manifest(url), str(tmp_path / f"cache-{limit}"), cache_limit=limit)
        cache.open(0).close()
        cache.open(1).close()
        assert cache.is_cached(0) is kept and cache.is_cached(1), limit
        assert cache.stats.evictions == (0 if kept else 1)

    held_cache = ShardCache(Storage(url), load_manifest(url), str(tmp_path / "held"), cache_limit=size + need - 1,
                            wait_timeout=0.5)
    held = held_cache.open(0)
    with pytest.raises(CacheLimitError, match=f"this process alone hold {size} bytes"):
        held_cache.open(1)
    held.close()
    held = held_cache.open(1)  # released: shard 0 is evictable again
    assert held_cache.is_cached(1) and not held_cache.is_cached(0)
    with pytest.raises(CacheLimitError, match=f"this process alone hold {size} bytes"):
        held_cache.open(2)  # shard 0's bytes no longer count as held
    held.close()


def test_a_reader_lets_go_of_the_shards_it_has_read_before_it_opens_the_next(tmp_path):
    """A reader holds the shards of the chunk it reads (and of the next, once open), not the last chunk's while it
    opens this one's: under cache_limit an open waits for room, and readers that kept the shards they were done
    with pinned all of it (the 16 processes of test_kill_matrix). With room for one shard, an unshuffled pass of
    one shard per chunk reads every shard; holding the last one meant `CacheLimitError` at the second."""
    from shardkit import StreamingDataLoader, StreamingDataset

    url = str(tmp_path / "ds")
    write_fixed(url, 90, per_shard=30)
    data = StreamingDataset(url, cache_dir=str(tmp_path / "cache"), cache_limit=shard_room(tmp_path, url),
                            cache_wait=0.5, shuffle=False, chunk_samples=30, rank=0, world_size=1)
    ids = [int(i) for batch in StreamingDataLoader(data, batch_size=10) for i in batch["sample_id"]]
    assert ids == list(range(90))


def test_a_limit_of_zero_bytes_is_refused(tmp_path):
    url = str(tmp_path / "ds")
    write_fixed(url, 30, per_shard=30)
    with pytest.raises(ValueError, match="cache_limit must be a positive number of bytes"):
        local_cache(tmp_path, url, cache_limit=0)
    local_cache(tmp_path, url, cache_limit=1)  # one byte is a (useless) limit, not an error here


def test_stats_count_downloads_bytes_and_hits(tmp_path):
    url = str(tmp_path / "ds")
    manifest = write_fixed(url, 60, per_shard=30)
    cache = local_cache(tmp_path, url)
    assert (cache.stats.downloads, cache.stats.downloaded_bytes, cache.stats.hits, cache.stats.range_reads) == (0, 0, 0, 0)
    cache.open(0).close()
    cache.open(1).close()
    cache.open(0).close()
    assert cache.stats.downloads == 2 and cache.stats.hits == 1 and cache.stats.range_reads == 0
    assert cache.stats.downloaded_bytes == manifest.shards[0].compressed_bytes + manifest.shards[1].compressed_bytes


@pytest.mark.parametrize("mode", ["compressed", "none"])
def test_stats_of_the_in_memory_modes(tmp_path, mode):
    """"compressed" keeps the verified shard bytes and reads them again as a hit; "none" downloads each time."""
    url = str(tmp_path / "ds")
    manifest = write_fixed(url, 60, per_shard=30)
    cache = local_cache(tmp_path, url, cache_mode=mode)
    for _ in range(2):
        cache.open(0).close()
    downloads = 1 if mode == "compressed" else 2
    assert (cache.stats.downloads, cache.stats.hits) == (downloads, 2 - downloads)
    assert cache.stats.downloaded_bytes == downloads * manifest.shards[0].compressed_bytes


def test_eviction_removes_the_least_recently_used_shard(tmp_path):
    """Room for 3 shards: after using 0, 1, 2 and then 0 again, shard 1 is the least recently used
    and is the one evicted for shard 3; then 2 for shard 4 (most-recently-used eviction would take 0)."""
    url = str(tmp_path / "ds")
    write_fixed(url, 150, per_shard=30)
    size = decoded_file_size(tmp_path, url)
    cache = local_cache(tmp_path, url, cache_limit=3 * size + size // 2)
    for index in (0, 1, 2, 0, 3):
        cache.open(index).close()
        time.sleep(0.02)  # distinct use times, whatever the file system's timestamp resolution
    assert [cache.is_cached(i) for i in range(5)] == [True, False, True, True, False]
    cache.open(4).close()
    assert [cache.is_cached(i) for i in range(5)] == [True, False, False, True, True]
    assert cache.stats.evictions == 2


def cache_bytes(cache_dir: str) -> int:
    """Bytes of decoded shards under `cache_dir` now (files listed at one instant, stat'ed after)."""
    total = 0
    for directory, _, names in os.walk(cache_dir):
        for name in names:
            if name.endswith(".skd") and not name.startswith("."):
                try:
                    total += os.path.getsize(os.path.join(directory, name))
                except FileNotFoundError:
                    pass  # evicted since the listing: it no longer counts
    return total


@pytest.mark.slow
def test_cache_limit_holds_at_its_peak_with_eight_processes(process_pool, tmp_path):
    """A watcher samples the cache's size while 8 processes open shards under a limit: the peak,
    not just the end state, stays within the limit (admission and eviction are node-wide atomic)."""
    import threading

    url = str(tmp_path / "ds")
    write_fixed(url, 24 * 20, seq_len=64, per_shard=20)
    cache_dir = str(tmp_path / "cache")
    limit = 10 * decoded_file_size(tmp_path, url)
    rng = random.Random(6)
    orders = [[rng.randrange(24) for _ in range(40)] for _ in range(8)]
    peak, samples, done = [0], [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], cache_bytes(cache_dir))
            samples[0] += 1

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        results = process_pool.run(open_shards, [dict(url=url, cache_dir=cache_dir, order=o, cache_limit=limit,
                                                      hold=0) for o in orders])
    finally:
        done.set()
        watcher.join()
    assert all(r["bad"] == 0 for r in results)
    assert sum(r["evictions"] for r in results) > 0 and samples[0] > 100
    assert peak[0] <= limit, f"peak {peak[0]} bytes over the limit {limit} ({samples[0]} samples)"
    assert not [f for _, _, fs in os.walk(cache_dir) for f in fs if ".tmp-" in f]


@pytest.mark.slow
@pytest.mark.s3
def test_sigkill_during_download_leaves_nothing_that_blocks_or_poisons(s3_bucket, tmp_path):
    url, options = s3_bucket
    write_fixed(url, 1500, seq_len=2048, per_shard=1500, docs=False, storage_options=options)
    manifest = load_manifest(url, options)
    cache_dir = str(tmp_path / "cache")
    probe = ShardCache(Storage(url, options), manifest, cache_dir)
    lock = probe.path(0) + ".dl"
    os.makedirs(os.path.dirname(lock), exist_ok=True)
    ctx = mp.get_context("spawn")
    for delay in (0.0, 0.05, 0.15):
        victim = ctx.Process(target=open_shards, kwargs=dict(url=url, cache_dir=cache_dir, order=[0],
                                                             storage_options=options, env=S3_TEST_CREDENTIALS))
        victim.start()
        deadline = time.monotonic() + 60
        while not lock_is_held(lock):
            assert time.monotonic() < deadline and victim.is_alive(), "the victim never started its download"
            time.sleep(0.002)
        time.sleep(delay)
        os.kill(victim.pid, signal.SIGKILL)
        victim.join()
        if probe.is_cached(0):
            break  # it finished before the kill: the file is whole (renamed atomically)
        assert not lock_is_held(lock), "a dead downloader must not keep the lock"
    # a survivor opens the shard: no hang, no partial file read, stale temporaries cleaned
    handle = probe.open(0)
    np.testing.assert_array_equal(ids_from_tokens(handle.reader.gather(np.arange(1500))), np.arange(1500))
    handle.close()
    leftovers = [f for _, _, fs in os.walk(cache_dir) for f in fs if ".tmp-" in f]
    assert leftovers == []


def test_the_holder_removes_the_temporaries_a_killed_writer_left(tmp_path):
    """What a write killed mid-way leaves (the core's atomic write, or the hidden spelling of older versions),
    the next holder of the shard's download lock removes, and nothing of other files."""
    from shardkit.loaders.cache.directory import remove_stale_temporaries
    from shardkit.storage import atomic_path

    path = str(tmp_path / "shard-0.tar.0123456789abcdef.skd")
    killed = atomic_path(path, fsync=False)  # entered and never left: the process died inside the block
    with open(killed.__enter__(), "xb") as fh:
        fh.write(b"half a shard")
    (tmp_path / ".shard-0.tar.0123456789abcdef.skd.tmp-abc").write_bytes(b"older")
    (tmp_path / "shard-1.tar.0123456789abcdef.skd.tmp-abc").write_bytes(b"another shard's, being written")
    remove_stale_temporaries(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-1.tar.0123456789abcdef.skd.tmp-abc"]


def test_a_fresh_node_gets_the_manifest_and_its_index_at_once(tmp_path, monkeypatch):
    """The index's GET of a node's first manifest read is in flight with the JSON's requests (one round trip
    saved), and on fsspec, whose copy answers no identity, the JSON's GET starts after the HEAD whose identity
    the node records (so the copy is never older than it). obstore's single GET: test_manifest_one_request.py."""
    import shardkit.loaders.cache.shard_cache as cache_module

    url = f"memory://fresh-node-{os.getpid()}"
    write_fixed(url, 64)
    from shardkit.storage import FsspecObjects

    calls: list[tuple[str, float, float]] = []
    download, identity = FsspecObjects.download, FsspecObjects.identity

    def slow(method, label):  # the store's requests, as the backend makes them
        def call(self, path, *args):
            start = time.perf_counter()
            time.sleep(0.2)  # a round trip long enough that serial calls cannot overlap
            try:
                return method(self, path, *args)
            finally:
                calls.append((label + path.rsplit("/", 1)[-1], start, time.perf_counter()))
        return call

    monkeypatch.setattr(FsspecObjects, "download", slow(download, "GET "))
    monkeypatch.setattr(FsspecObjects, "identity", slow(identity, "HEAD "))
    manifest = cache_module.fetch_manifest(Storage(url), str(tmp_path / "node"))
    assert manifest == load_manifest(url)
    head = next(c for c in calls if c[0].startswith("HEAD"))
    gets = sorted(c for c in calls if c[0].startswith("GET"))
    assert [c[0] for c in gets] == ["GET shardkit.blocks", "GET shardkit.index", "GET shardkit.json"]
    json_get = gets[2]
    assert json_get[1] >= head[2], calls  # the JSON after its identity
    for extra in gets[:2]:  # the index and the block indexes in flight with them
        assert extra[1] < json_get[2] and head[1] < extra[2], calls
