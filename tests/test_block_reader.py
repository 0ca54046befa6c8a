"""`BlockReader` (loaders/cache/block_reader.py) on its own, in-process: a format v2 shard read block by block.

The contract the cache relies on: `ensure(samples)` returns with exactly those samples' tokens in place, having read
only their blocks (and the index); `start_index` / `request` / `wait` over several shards gives each its blocks;
the background completion hands the whole, verified shard to `on_complete` once (its file's bytes too when kept),
after which nothing is read again; a corrupt block is read twice and then named, for every later request too; a
cancelled completion stores nothing. The loader's cold path over these is tests/test_blocks.py.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from loader_helpers import ids_from_tokens
from shardkit.errors import CorruptShardError
from shardkit.formats import decode_shard
import shardkit.loaders.cache.block_reader as block_reader_module
from shardkit.loaders.cache.block_reader import BlockReader
from shardkit.storage import Storage
from test_blocks import SEQ, block_index, flip_byte, write_blocks

PER_SHARD = 240


@pytest.fixture
def dataset(tmp_path):
    """Two shards of 240 fixed-length samples in ~16 blocks each, on local storage."""
    url = str(tmp_path / "ds")
    return url, write_blocks(url, 2 * PER_SHARD, per_shard=PER_SHARD)


def reader_of(url, manifest, shard=0, **options):
    reads: list[int] = []
    storage = Storage(url)
    reader = BlockReader(lambda: storage, manifest.shards[shard], manifest, executor=ThreadPoolExecutor(2),
                         on_read=reads.append, **options)
    return reader, reads


def sample_ids(reader: BlockReader, local: np.ndarray) -> np.ndarray:
    return ids_from_tokens(np.stack([reader.reader.tokens(int(i)) for i in local]))


def test_ensure_reads_only_the_blocks_of_the_samples_asked(dataset, monkeypatch):
    url, manifest = dataset
    # The whole shard is ~100 KB: blocks that far apart would be merged into one read (COALESCE_GAP_BYTES).
    monkeypatch.setattr(block_reader_module, "COALESCE_GAP_BYTES", 0)
    reader, reads = reader_of(url, manifest, shard=1)
    index = block_index(url, manifest.shards[1])
    wanted = np.array([0, 1, PER_SHARD - 1])
    reader.ensure(wanted)
    np.testing.assert_array_equal(sample_ids(reader, wanted), PER_SHARD + wanted)
    first, last = index.blocks[0], index.blocks[-1]
    block_bytes = (first.byte_end - first.byte_start) + (last.byte_end - last.byte_start)
    assert sum(reads) == manifest.shards[1].index_bytes + block_bytes, "read more than the index and two blocks"
    assert len(index.blocks) > 8 and not reader.complete


def test_local_blocks_are_read_one_each_and_never_the_ones_between(dataset, monkeypatch):
    """From local storage a request costs nothing to save: blocks close together are read and decoded one by one,
    without the blocks between them that a merged remote read would fetch (`COALESCE_GAP_BYTES`)."""
    url, manifest = dataset
    reader, reads = reader_of(url, manifest)
    blocks = block_index(url, manifest.shards[0]).blocks
    assert blocks[4].byte_start - blocks[2].byte_end <= block_reader_module.COALESCE_GAP_BYTES
    wanted = np.array([blocks[2].sample_start, blocks[4].sample_start])
    reader.ensure(wanted)
    np.testing.assert_array_equal(sample_ids(reader, wanted), wanted)
    assert reads[1:] == [blocks[k].byte_end - blocks[k].byte_start for k in (2, 4)], "not one read per needed block"
    assert [k for k, state in enumerate(reader._state) if state == block_reader_module._DONE] == [2, 4]


def test_large_local_blocks_are_decoded_beside_the_caller(dataset, monkeypatch):
    """A request's local blocks, when large (`PARALLEL_DECODE_BLOCK_BYTES`), are decoded by the pool's threads and
    the caller's at once, each block once; a corrupt one among them is still named, after the others are in."""
    url, manifest = dataset
    monkeypatch.setattr(block_reader_module, "PARALLEL_DECODE_BLOCK_BYTES", 0)
    monkeypatch.setattr(block_reader_module, "available_cores", lambda: 2)
    loaded: list[tuple[int, str]] = []
    load_block = BlockReader._load_block

    def recording(self, number, data=None):
        loaded.append((number, threading.current_thread().name))
        return load_block(self, number, data)

    monkeypatch.setattr(BlockReader, "_load_block", recording)
    reader, _ = reader_of(url, manifest)
    blocks = block_index(url, manifest.shards[0]).blocks
    wanted = np.array([blocks[k].sample_start for k in range(0, 12, 2)])
    reader.ensure(wanted)
    np.testing.assert_array_equal(sample_ids(reader, wanted), wanted)
    assert sorted(number for number, _ in loaded) == list(range(0, 12, 2)), "a block decoded twice, or one missed"
    assert {name for _, name in loaded} - {"MainThread"}, "no block was decoded beside the caller"

    flip_byte(url, manifest.shards[0].name, (blocks[13].byte_start + blocks[13].byte_end) // 2)
    with pytest.raises(CorruptShardError, match="block 13"):
        reader.ensure([blocks[k].sample_start for k in (12, 13, 14, 15)])
    assert sample_ids(reader, np.array([blocks[12].sample_start])).tolist() == [blocks[12].sample_start]


def test_requests_over_two_shards_are_waited_for_together(dataset):
    url, manifest = dataset
    readers = [reader_of(url, manifest, shard=s)[0] for s in (0, 1)]
    for reader in readers:
        reader.start_index()
    requests = [reader.request(np.arange(100, 140)) for reader in readers]
    for request in requests:
        request.wait()
    for shard, reader in enumerate(readers):
        np.testing.assert_array_equal(sample_ids(reader, np.arange(100, 140)), shard * PER_SHARD + np.arange(100, 140))


@pytest.mark.parametrize("keep_bytes", [False, True])
def test_the_completion_hands_over_the_whole_verified_shard_once(dataset, keep_bytes):
    url, manifest = dataset
    handed: list = []
    reader, reads = reader_of(url, manifest, on_complete=lambda arrays, data: handed.append((arrays, data)),
                              keep_bytes=keep_bytes)
    reader.complete_in_background()
    reader.ensure([3])  # the first batch reads its own block; the completion starts at the second
    assert not handed and reader._completion is None
    reader.ensure([200])
    assert reader.wait_complete(30) and reader.complete and len(handed) == 1
    shard = manifest.shards[0]
    data = Storage(url).read_bytes(shard.name)
    whole = decode_shard(data, shard_format=manifest.shard_format, token_dtype=manifest.token_dtype,
                         shard=shard.name, raw_bytes=shard.raw_bytes)
    arrays, kept = handed[0]
    np.testing.assert_array_equal(arrays.tokens, whole.tokens)
    np.testing.assert_array_equal(arrays.sample_offsets, whole.sample_offsets)
    assert (bytes(kept) == data) if keep_bytes else kept is None
    before = sum(reads)
    reader.ensure(np.arange(PER_SHARD))
    assert sum(reads) == before, "a complete shard was read again"
    np.testing.assert_array_equal(sample_ids(reader, np.arange(0, PER_SHARD, 7)), np.arange(0, PER_SHARD, 7))


def test_a_corrupt_block_is_read_twice_then_named_for_every_later_request(dataset):
    url, manifest = dataset
    shard = manifest.shards[0]
    bad = block_index(url, shard).blocks[4]
    flip_byte(url, shard.name, (bad.byte_start + bad.byte_end) // 2)
    reader, reads = reader_of(url, manifest)
    reader.ensure([0])  # other blocks are intact
    before = len(reads)
    with pytest.raises(CorruptShardError, match=rf"{shard.name}: block 4 .* on each of 2 reads"):
        reader.ensure([bad.sample_start])
    assert len(reads) - before == 2, "the corrupt block was not read exactly twice (a read and one re-read)"
    with pytest.raises(CorruptShardError, match="block 4"):
        reader.ensure([0])


def test_a_cancelled_completion_stores_nothing(dataset):
    url, manifest = dataset
    handed, failed = [], []
    reader, _ = reader_of(url, manifest, on_complete=lambda arrays, data: handed.append(arrays))
    reader.complete_in_background(on_failure=lambda: failed.append(True))
    reader.ensure([0])
    reader.cancel()
    reader.start_completion()
    assert not reader.wait_complete(30) and not handed and failed == [True]


def test_a_shard_without_a_block_index_is_refused(tmp_path):
    url = str(tmp_path / "v1")
    manifest = write_blocks(url, PER_SHARD, per_shard=PER_SHARD, format_version=1)
    with pytest.raises(ValueError, match=rf"shard {manifest.shards[0].name} has no block index .*read it whole"):
        reader_of(url, manifest)
    assert SEQ + 1 == manifest.sample_length


def test_a_corrupt_block_found_by_the_completion_stores_nothing_and_is_raised_by_the_next_request(dataset):
    url, manifest = dataset
    shard = manifest.shards[0]
    bad = block_index(url, shard).blocks[9]
    flip_byte(url, shard.name, (bad.byte_start + bad.byte_end) // 2)
    handed, failed = [], []
    reader, _ = reader_of(url, manifest, on_complete=lambda arrays, data: handed.append(arrays))
    reader.complete_in_background(on_failure=lambda: failed.append(True))
    reader.ensure([0])
    reader.start_completion()
    assert not reader.wait_complete(30) and not handed and failed == [True]
    with pytest.raises(CorruptShardError, match="block 9"):
        reader.ensure([1])  # an intact, already read sample: the shard as a whole is refused
