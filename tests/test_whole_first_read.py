"""A small cold shard's first read takes it whole (issue 47, item 3): one GET brings the block index and every
block, so a first batch waits for one round trip after the manifest instead of two in a row; each block is still
checked against the index, and the index against the manifest, before use. Counted at moto's S3 server on loopback
(`WHOLE_FIRST_READ_BYTES`, loaders/cache/block_reader.py), on obstore and on fsspec; a damaged or cut body is read
again, and a corrupt index is refused naming the shard."""

from __future__ import annotations

import numpy as np
import pytest

from fault_proxy import through_proxy
from loader_helpers import ids_from_tokens
from s3_proxy import CountingProxy
from test_blocks import serial_steps, slow_reads_until_released, write_blocks

import shardkit.loaders.cache.block_reader as block_reader_module
import shardkit.loaders.cache.shard_cache as cache_module
from shardkit import StreamingDataset
from shardkit.errors import CorruptShardError
from shardkit.storage import Storage

pytestmark = [pytest.mark.s3, pytest.mark.usefixtures("storage_client")]

SAMPLES, PER_SHARD = 480, 120  # 4 tar shards of ~50 KB in ~15 blocks each


@pytest.fixture(autouse=True)
def block_by_block(monkeypatch):
    """Shards this small are read whole and decoded at once (`WHOLE_READ_BYTES`): here they go through the block
    reader, as a 2-8 MiB shard does."""
    monkeypatch.setattr(cache_module, "WHOLE_READ_BYTES", 0)


def _stream(url, options, tmp_path, name="cache"):
    dataset = StreamingDataset(url, cache_dir=str(tmp_path / name), batch_size=8, shuffle_window=SAMPLES,
                               storage_options=options, prefetch=False)
    return iter(dataset)


def _check(batches, first) -> None:
    """Every sample once, each with its own tokens."""
    rest = list(batches)
    for batch in [first, *rest]:
        np.testing.assert_array_equal(ids_from_tokens(batch["tokens"]), batch["sample_id"].numpy())
    ids = np.concatenate([b["sample_id"].numpy() for b in [first, *rest]])
    np.testing.assert_array_equal(np.sort(ids), np.arange(SAMPLES))


def _shard_gets(proxy: CountingProxy, manifest) -> dict[str, tuple[int, int]]:
    """(GETs, bytes) of each shard object."""
    out = {}
    for shard in manifest.shards:
        gets = sum(n for path, n in proxy.gets(shard.name).items())
        out[shard.name] = (gets, sum(n for path, n in proxy.bytes_out.items() if path.endswith(shard.name)))
    return out


def test_a_first_batch_reads_each_small_shard_in_one_request(s3_bucket, s3_endpoint, tmp_path):
    """Each shard a shuffled first batch touches costs one GET of the whole object (no index GET before its block
    GETs), and the background completion reads nothing more of it."""
    url, direct = s3_bucket
    manifest = write_blocks(url, SAMPLES, per_shard=PER_SHARD, storage_options=direct)
    proxy = CountingProxy(s3_endpoint)
    try:
        batches = _stream(url, {**direct, "endpoint_url": proxy.url}, tmp_path)
        first = next(batches)
        touched = {name: counted for name, counted in _shard_gets(proxy, manifest).items() if counted[0]}
        sizes = {shard.name: shard.compressed_bytes for shard in manifest.shards}
        assert len(touched) >= 2, "the shuffled first batch spans a single shard: nothing to count"
        assert touched == {name: (1, sizes[name]) for name in touched}, touched
        _check(batches, first)
        assert _shard_gets(proxy, manifest) == {name: (1, size) for name, size in sizes.items()}, \
            "a shard read whole was read again"
    finally:
        proxy.close()


def test_above_the_threshold_the_index_comes_before_the_blocks(s3_bucket, s3_endpoint, tmp_path, monkeypatch):
    """A shard larger than `WHOLE_FIRST_READ_BYTES` keeps the ranged reads: its index, then its blocks."""
    monkeypatch.setattr(block_reader_module, "WHOLE_FIRST_READ_BYTES", 10_000)
    url, direct = s3_bucket
    manifest = write_blocks(url, SAMPLES, per_shard=PER_SHARD, storage_options=direct)
    assert all(shard.compressed_bytes > 10_000 for shard in manifest.shards)
    proxy = CountingProxy(s3_endpoint)
    try:
        batches = _stream(url, {**direct, "endpoint_url": proxy.url}, tmp_path)
        first = next(batches)
        touched = [counted for counted in _shard_gets(proxy, manifest).values() if counted[0]]
        sizes = {shard.compressed_bytes for shard in manifest.shards}
        assert touched and all(gets >= 2 and nbytes not in sizes for gets, nbytes in touched), touched
        _check(batches, first)
    finally:
        proxy.close()


@pytest.mark.parametrize("kind", ["flip", "truncate"])
def test_a_whole_read_damaged_in_transit_is_read_again(faulty_bucket, tmp_path, kind):
    """Every shard's whole read arrives with a flipped bit, or cut short: a flipped index or block fails its hash
    and is read again alone, a cut body is retried by the storage layer; every sample arrives intact."""
    url, options, proxy = faulty_bucket
    options = through_proxy(options, checksums=False)  # no transport check: the flips reach shardkit's own
    manifest = write_blocks(url, SAMPLES, per_shard=PER_SHARD, storage_options=options)
    whole = {shard.name: f"bytes=0-{shard.compressed_bytes - 1}" for shard in manifest.shards}

    def whole_read(method: str, target: str, range_header: str | None) -> bool:
        name = target.split("?")[0].rsplit("/", 1)[-1]
        return method == "GET" and range_header is not None and whole.get(name) == range_header

    proxy.configure(rate=1.0, seed=5, kinds=(kind,), first_only=True, only=whole_read)
    batches = _stream(url, options, tmp_path)
    first = next(batches)
    _check(batches, first)
    assert proxy.snapshot().get(kind, 0) == len(whole), proxy.snapshot()


def test_a_corrupt_index_is_refused_naming_the_shard(s3_bucket, tmp_path):
    """An index that differs from the manifest's hash in the store (not in transit) fails the whole read's check
    and its re-read alone: the error names the shard and its block index."""
    url, direct = s3_bucket
    manifest = write_blocks(url, SAMPLES, per_shard=PER_SHARD, storage_options=direct)
    for shard in manifest.shards:
        _flip_stored(url, direct, shard.name, shard.index_offset + shard.index_bytes // 2)
    batches = _stream(url, direct, tmp_path)
    with pytest.raises(CorruptShardError, match=r"shard-\d+\.tar.*block index .* on each of 2 reads"):
        next(batches)


def _flip_stored(url, options, name, position) -> None:
    storage = Storage(url, options)
    data = bytearray(storage.read_bytes(name))
    data[position] ^= 0x01
    storage.write_bytes(name, bytes(data))


def test_a_first_batch_over_two_cold_shards_waits_for_one_round_trip(s3_bucket, tmp_path, monkeypatch):
    """Both shards are read whole at once, and nothing else before the first batch: one round trip after the
    manifest (block by block it is two: tests/test_blocks.py)."""
    url, options = s3_bucket
    write_blocks(url, SAMPLES, per_shard=SAMPLES // 2, storage_options=options)
    first_batch_out, reads = slow_reads_until_released(monkeypatch)
    batches = _stream(url, options, tmp_path)
    try:
        first = next(batches)
        before = list(reads)
    finally:
        first_batch_out.set()
    assert sorted(set(first["sample_id"].numpy() // (SAMPLES // 2))) == [0, 1]  # the batch spans both shards
    assert len(before) == 2 and all(start == 0 for _, start, *_ in before), before
    assert serial_steps([(b, e) for *_, b, e in before]) == 1, before
    _check(batches, first)
