"""Format v2 (per-block SHA-256 index) and the loader's cold path: blocks read by range before the shard
is local, each verified (a corrupt block is re-read once, then named), the shard completed in the
background, and every `cache_mode` yielding the same stream as "decoded", resume included."""

from __future__ import annotations

import itertools
import json
import os
import threading
import time

import numpy as np
import pytest

from loader_helpers import VOCAB, fixed_sample, ids_from_tokens, write_fixed
from resume_contract import check_resume
from s3_proxy import CountingProxy
from shardkit.block_indexes import BLOCK_INDEXES_NAME
from shardkit.errors import CorruptShardError
from shardkit.formats import decode_shard, write_dataset
from shardkit.formats.blocks import BlockIndex
from shardkit.formats.shard_bytes import decode_block
from shardkit.formats import shard_bytes as shard_bytes_module
import shardkit.loaders.cache.block_reader as block_reader_module
import shardkit.loaders.cache.shard_blocks as shard_blocks_module
import shardkit.loaders.cache.shard_cache as cache_module
from shardkit.loaders.config import CACHE_MODES
from shardkit.loaders.cache.block_reader import BlockReader
from shardkit.manifest import MANIFEST_NAME, TokenizerInfo, load_manifest
from shardkit.storage import Storage

SEQ = 64
BLOCK_BYTES = 1536  # ~8 samples of 65 uint16 tokens per block: many blocks in a small shard


@pytest.fixture
def cold_blocks(monkeypatch):
    """Read every v2 shard block by block, however small (the real threshold is 2 MiB)."""
    monkeypatch.setattr(cache_module, "WHOLE_READ_BYTES", 0)


def write_blocks(url: str, num_samples: int = 480, *, per_shard: int = 240, shard_format: str = "tar",
                 format_version: int = 2, storage_options: dict | None = None):
    samples = (fixed_sample(i, SEQ + 1) for i in range(num_samples))
    return write_dataset(url, samples, tokenizer=TokenizerInfo(kind="byte", name="test", vocab_size=VOCAB),
                         seq_len=SEQ, packing="concat", shard_format=shard_format, max_samples=per_shard,
                         format_version=format_version, block_bytes=BLOCK_BYTES, storage_options=storage_options)


def block_index(url: str, shard) -> BlockIndex:
    data = Storage(url).read_bytes(shard.name)
    return BlockIndex.from_bytes(data[shard.index_offset:shard.index_offset + shard.index_bytes], shard=shard.name,
                                 samples=shard.samples, tokens=shard.tokens, raw_bytes=shard.raw_bytes,
                                 index_offset=shard.index_offset)


@pytest.mark.parametrize("shard_format", ["tar", "arrow"])
def test_each_block_decodes_alone_to_its_part_of_the_shard(tmp_path, shard_format):
    url = str(tmp_path / "ds")
    manifest = write_blocks(url, 240, shard_format=shard_format)
    assert manifest.format_version == (3 if shard_format == "tar" else 2)  # tar: the group layout
    shard = manifest.shards[0]
    data = Storage(url).read_bytes(shard.name)
    whole = decode_shard(data, shard_format=shard_format, token_dtype="uint16", shard=shard.name,
                         raw_bytes=shard.raw_bytes)
    index = block_index(url, shard)
    assert len(index.blocks) > 10
    for number, block in enumerate(index.blocks):
        part = decode_block(data[block.byte_start:block.byte_end], block, number=number, shard_format=shard_format,
                            token_dtype="uint16", has_docs=True, shard=shard.name)
        np.testing.assert_array_equal(part.tokens, whole.tokens[block.token_start:block.token_end])
        np.testing.assert_array_equal(part.doc_index, whole.doc_index[block.doc_start:block.doc_end])


def test_version_1_shards_still_read(tmp_path, cold_blocks):
    """A v1 dataset (no index fields, format_version 1) loads and streams exactly like its v2 twin."""
    v1, v2 = str(tmp_path / "v1"), str(tmp_path / "v2")
    write_blocks(v1, format_version=1)
    write_blocks(v2)
    text = json.loads((tmp_path / "v1" / MANIFEST_NAME).read_text())
    assert text["format_version"] == 1 and not any("index_sha256" in s for s in text["shards"])
    assert load_manifest(v2).format_version == 3  # tar in the group layout
    from shardkit.loaders.dataset import StreamingDataset

    def stream(url: str, cache: str) -> list[np.ndarray]:
        dataset = StreamingDataset(url, cache_dir=str(tmp_path / cache), batch_size=8, shuffle_window=100)
        return [b["sample_id"].numpy().copy() for b in dataset]

    got, want = stream(v1, "c1"), stream(v2, "c2")
    assert len(got) == 60 and all(np.array_equal(a, b) for a, b in zip(got, want))


def test_tar_of_either_layout_streams_exactly_what_arrow_streams(tmp_path, cold_blocks):
    """The same samples as Arrow, as group layout tar and as a tar dataset whose first shard is of the
    per-sample layout (written before the group layout, kept as it is): every mode gives the same batches,
    same ids, same tokens and segments, every sample once."""
    from dataclasses import replace

    from shardkit.formats import ShardReader, encode_shard
    from shardkit.loaders.dataset import StreamingDataset
    from shardkit.manifest import write_manifest

    urls = {name: str(tmp_path / name) for name in ("arrow", "tar", "mixed")}
    write_blocks(urls["arrow"], 480, shard_format="arrow")
    write_blocks(urls["tar"], 480)
    mixed = write_blocks(urls["mixed"], 480)
    storage, first = Storage(urls["mixed"]), mixed.shards[0]
    arrays = ShardReader.from_bytes(storage.read_bytes(first.name), shard=first, manifest=mixed).arrays
    old = encode_shard(arrays, shard_format="tar", token_dtype="uint16", block_bytes=BLOCK_BYTES, tar_layout="samples")
    storage.write_bytes(first.name, old.data)
    write_manifest(storage, replace(mixed, shards=(replace(first, compressed_bytes=len(old.data), raw_bytes=old.raw_bytes,
                                                           sha256=old.sha256, index_offset=old.index_offset,
                                                           index_bytes=old.index_bytes, index_sha256=old.index_sha256),
                                                   *mixed.shards[1:])))

    def run(name: str, mode: str) -> list[np.ndarray]:
        dataset = StreamingDataset(urls[name], cache_dir=str(tmp_path / f"cache-{name}-{mode}"), batch_size=8,
                                   shuffle_window=200, cache_mode=mode)
        return [np.concatenate([b["sample_id"].numpy(), b["tokens"].numpy().ravel(), b["cu_seqlens"].numpy()])
                for b in dataset]

    want = run("arrow", "decoded")
    ids = np.concatenate([batch[:8] for batch in want])
    np.testing.assert_array_equal(np.sort(ids), np.arange(480))
    for name in ("tar", "mixed"):
        for mode in ("decoded", "none"):
            got = run(name, mode)
            assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want)), (name, mode)


@pytest.mark.s3
def test_cold_first_batch_comes_from_ranged_reads(s3_bucket, s3_endpoint, tmp_path, cold_blocks, monkeypatch):
    """The first batch of a cold shard costs the index and a few blocks, counted at a real S3 endpoint;
    the background completion then fetches the rest once and stores the decoded shard."""
    url, direct = s3_bucket
    manifest = write_blocks(url, 960, per_shard=960, storage_options=direct)
    shard = manifest.shards[0]
    # This shard is ~400 KB: the reader's coalescing of blocks less than 256 KiB apart would merge the
    # batch's reads into most of it. Counted here is what the batch needs, so no merging.
    import shardkit.loaders.cache.block_reader as block_reader_module

    monkeypatch.setattr(block_reader_module, "COALESCE_GAP_BYTES", 0)
    # Hold the background completion until the first batch is out, so the count is the first batch's alone.
    first_batch_out = threading.Event()
    complete = BlockReader._complete
    monkeypatch.setattr(BlockReader, "_complete", lambda self: (first_batch_out.wait(30), complete(self)))
    proxy = CountingProxy(s3_endpoint)
    try:
        from shardkit.loaders.dataset import StreamingDataset

        dataset = StreamingDataset(url, cache_dir=str(tmp_path / "cache"), batch_size=8, shuffle_window=960,
                                   storage_options={**direct, "endpoint_url": proxy.url})
        batches = iter(dataset)
        first = next(batches)
        path = proxy.gets(".tar")
        first_bytes = sum(n for p, n in proxy.bytes_out.items() if p.endswith(shard.name))
        assert first_bytes < shard.compressed_bytes / 4, (first_bytes, shard.compressed_bytes)
        assert sum(path.values()) <= 1 + 8  # the index, then at most one ranged GET per sample's block
        first_batch_out.set()
        rest = [b["sample_id"].numpy() for b in batches]
        ids = np.concatenate([first["sample_id"].numpy(), *rest])
        np.testing.assert_array_equal(np.sort(ids), np.arange(960))
        np.testing.assert_array_equal(ids_from_tokens(first["tokens"]), first["sample_id"].numpy())
        cache = dataset.caches[0]
        for _ in range(100):  # the completion thread stores the decoded copy after the whole-shard check
            if cache.is_cached(0):
                break
            threading.Event().wait(0.05)
        assert cache.is_cached(0)
        total = sum(n for p, n in proxy.bytes_out.items() if p.endswith(shard.name))
        assert total <= shard.compressed_bytes + first_bytes  # the rest once, not the whole shard again
    finally:
        proxy.close()


def serial_steps(intervals: list[tuple[float, float]]) -> int:
    """The most intervals that follow one another without overlapping: the round trips a reader waited
    for one after another."""
    steps, free_at = 0, float("-inf")
    for start, end in sorted(intervals, key=lambda i: i[1]):
        if start >= free_at:
            steps, free_at = steps + 1, end
    return steps


@pytest.mark.s3
@pytest.mark.parametrize("with_file", [False, True], ids=["built-before-shardkit.blocks", "with-shardkit.blocks"])
def test_a_first_batch_over_two_cold_shards_waits_for_two_round_trips(s3_bucket, tmp_path, cold_blocks,
                                                                      monkeypatch, with_file):
    """Both shards' block indexes are read at once, then every block the batch needs at once: two round
    trips before the first batch, not an index and its blocks per shard one after the other. With the
    dataset's `shardkit.blocks` (fetched with the manifest) the indexes are at hand: one round trip."""
    url, options = s3_bucket
    manifest = write_blocks(url, 480, per_shard=240, storage_options=options)
    if not with_file:
        Storage(url, options).delete(BLOCK_INDEXES_NAME)  # a dataset built before the file
    first_batch_out = threading.Event()
    complete = BlockReader._complete
    monkeypatch.setattr(BlockReader, "_complete", lambda self: (first_batch_out.wait(30), complete(self)))
    reads: list[tuple[str, int, float, float]] = []
    read_range = Storage.read_range

    def slow(self, name, start, end):
        began = time.perf_counter()
        time.sleep(0.2)  # a round trip long enough that reads one after another cannot overlap
        try:
            return read_range(self, name, start, end)
        finally:
            reads.append((name, start, began, time.perf_counter()))

    monkeypatch.setattr(Storage, "read_range", slow)
    from shardkit.loaders.dataset import StreamingDataset

    dataset = StreamingDataset(url, cache_dir=str(tmp_path / "cache"), batch_size=8, shuffle_window=480,
                               storage_options=options)
    try:
        first = next(iter(dataset))
        before = list(reads)
    finally:
        first_batch_out.set()
    shards = {s.name: s for s in manifest.shards}
    assert sorted(set(first["sample_id"].numpy() // 240)) == [0, 1]  # the batch spans both shards
    index_reads = [(b, e) for name, start, b, e in before if start == shards[name].index_offset]
    if with_file:
        assert index_reads == [] and serial_steps([(b, e) for *_, b, e in before]) == 1, before
    else:
        assert len(index_reads) == 2 and max(b for b, _ in index_reads) < min(e for _, e in index_reads), before
        assert serial_steps([(b, e) for *_, b, e in before]) == 2, before
    dataset.caches[0].drain(30)


def test_neighbouring_blocks_come_in_one_read_each_checked_alone(tmp_path, monkeypatch):
    """Blocks a batch needs from remote storage (memory:// here) that lie within `COALESCE_GAP_BYTES` of one
    another are read in one request, the blocks between them included; each is checked against its own hash,
    and a corrupt one among them is read again alone, then named, never used."""
    from concurrent.futures import ThreadPoolExecutor

    import shardkit.loaders.cache.block_reader as block_reader_module

    url = f"memory://{tmp_path.name}/ds"
    manifest = write_blocks(url, 240)
    shard = manifest.shards[0]
    blocks = block_index(url, shard).blocks
    reads: list[tuple[int, int]] = []
    read_range = Storage.read_range

    def counting(self, name, start, end):
        if start != shard.index_offset:
            reads.append((start, end))
        return read_range(self, name, start, end)

    def fresh() -> BlockReader:  # no background completion: every ensure reads its own blocks
        storage = Storage(url)
        return BlockReader(lambda: storage, shard, manifest, executor=ThreadPoolExecutor(2))

    monkeypatch.setattr(Storage, "read_range", counting)
    one_block = blocks[3].byte_end - blocks[3].byte_start
    monkeypatch.setattr(block_reader_module, "COALESCE_GAP_BYTES", one_block)
    partial = fresh()
    wanted = [blocks[2].sample_start, blocks[4].sample_start, blocks[9].sample_start]
    partial.ensure(wanted)
    # 2 and 4 are one block apart: one read of 2..4; 9 lies four blocks further.
    assert reads == [(blocks[2].byte_start, blocks[4].byte_end), (blocks[9].byte_start, blocks[9].byte_end)]
    assert ids_from_tokens(np.stack([partial.reader.tokens(i) for i in wanted])).tolist() == wanted
    between = blocks[3].sample_start  # read with them, checked and decoded too
    assert partial.reader.tokens(between).tolist() == fixed_sample(between, SEQ + 1).tokens.tolist()

    monkeypatch.setattr(block_reader_module, "COALESCE_GAP_BYTES", 0)  # only blocks that touch
    reads.clear()
    partial.ensure([blocks[11].sample_start, blocks[12].sample_start, blocks[14].sample_start])
    assert reads == [(blocks[11].byte_start, blocks[12].byte_end), (blocks[14].byte_start, blocks[14].byte_end)]

    monkeypatch.setattr(block_reader_module, "COALESCE_GAP_BYTES", one_block)
    flip_byte(url, shard.name, (blocks[21].byte_start + blocks[21].byte_end) // 2)
    reads.clear()
    with pytest.raises(CorruptShardError, match=rf"{shard.name}: block 21 .* on each of 2 reads"):
        fresh().ensure([blocks[20].sample_start, blocks[22].sample_start])
    assert reads == [(blocks[20].byte_start, blocks[22].byte_end), (blocks[21].byte_start, blocks[21].byte_end)]


def flip_byte(url: str, name: str, position: int) -> None:
    storage = Storage(url)
    data = bytearray(storage.read_bytes(name))
    data[position] ^= 0x01
    storage.write_bytes(name, bytes(data))


@pytest.mark.parametrize("shard_format", ["tar", "arrow"])
def test_corrupt_block_is_read_twice_then_named_and_never_yielded(tmp_path, cold_blocks, monkeypatch, shard_format):
    url = str(tmp_path / "ds")
    manifest = write_blocks(url, 240, shard_format=shard_format)
    shard = manifest.shards[0]
    index = block_index(url, shard)
    bad = index.blocks[5]
    flip_byte(url, shard.name, (bad.byte_start + bad.byte_end) // 2)
    reads = count_reads(monkeypatch)
    from shardkit.loaders.dataset import StreamingDataset

    dataset = StreamingDataset(url, cache_dir=str(tmp_path / "cache"), batch_size=4, shuffle=False,
                               cache_mode="none")
    seen: list[np.ndarray] = []
    with pytest.raises(CorruptShardError, match=rf"{shard.name}: block 5 \(bytes {bad.byte_start}-{bad.byte_end}, "
                                                rf"samples {bad.sample_start}-{bad.sample_end}\).* on each of 2 reads"):
        for batch in dataset:
            np.testing.assert_array_equal(ids_from_tokens(batch["tokens"]), batch["sample_id"].numpy())
            seen.append(batch["sample_id"].numpy().copy())
    seen_ids = np.concatenate(seen) if seen else np.zeros(0, dtype=np.int64)
    assert not np.any((seen_ids >= bad.sample_start) & (seen_ids < bad.sample_end))
    reads_of_bad = [(start, end) for start, end in reads if start <= bad.byte_start and end >= bad.byte_end]
    assert len(reads_of_bad) == 2, reads_of_bad  # the first read and one re-read


def test_bytes_outside_the_blocks_are_checked_only_where_they_are_kept(tmp_path, cold_blocks, monkeypatch):
    """A flipped byte in no block (the tar's end-of-archive padding) is in no sample. "compressed", which
    stores the file, checks the whole-shard SHA-256 at completion and the next read raises naming the shard;
    "none" and "decoded" use only the blocks (each checked), so they never read those bytes and deliver every
    sample intact: hashing the whole file as well would hash each byte twice."""
    url = str(tmp_path / "ds")
    manifest = write_blocks(url, 240)
    shard = manifest.shards[0]
    last = block_index(url, shard).blocks[-1]
    flipped = last.byte_end + 700  # inside the end-of-archive blocks
    flip_byte(url, shard.name, flipped)
    storage = Storage(url)
    reads = count_reads(monkeypatch)
    for mode in ("compressed", "none", "decoded"):
        reads.clear()
        cache = cache_module.ShardCache(storage, manifest, str(tmp_path / f"cache-{mode}"), cache_mode=mode)
        handle = cache.open(0, on_demand=True)
        handle.ensure([0])
        handle.ensure([1])  # the background completion starts from the second batch on
        handle.partial.wait_complete(30)
        if mode == "compressed":
            with pytest.raises(CorruptShardError, match=rf"{shard.name}: sha256 is .* on each of 2 reads"):
                handle.ensure([2])
            assert not handle.complete and not cache.is_cached(0)
            continue
        assert handle.complete and not any(start <= flipped < end for start, end in reads), (mode, reads)
        handle.ensure(range(shard.samples))
        for i in range(shard.samples):
            np.testing.assert_array_equal(handle.reader.sample(i).tokens, fixed_sample(i, SEQ + 1).tokens, err_msg=mode)
        assert cache.is_cached(0) == (mode == "decoded")


def test_a_completion_in_many_runs_reuses_its_buffer_without_mixing_blocks(tmp_path, cold_blocks, monkeypatch):
    """The background completion reads each run of blocks into one reused buffer: with runs of ~3 blocks
    (so every run overwrites the previous one's bytes), every sample still arrives intact."""
    import shardkit.loaders.cache.block_completion as block_completion_module

    url = str(tmp_path / "ds")
    manifest = write_blocks(url, 240, shard_format="arrow")
    shard = manifest.shards[0]
    blocks = block_index(url, shard).blocks
    monkeypatch.setattr(block_completion_module, "COMPLETION_RANGE_BYTES", 3 * (blocks[1].byte_end - blocks[1].byte_start))
    reads = count_reads(monkeypatch)
    cache = cache_module.ShardCache(Storage(url), manifest, str(tmp_path / "cache"), cache_mode="none")
    handle = cache.open(0, on_demand=True)
    handle.ensure([0])
    handle.ensure([1])
    assert handle.partial.wait_complete(30)
    assert len(reads) > len(blocks) // 3  # many runs, not one
    for i in range(shard.samples):
        np.testing.assert_array_equal(handle.reader.sample(i).tokens, fixed_sample(i, SEQ + 1).tokens)


def test_a_reader_that_stops_after_its_first_batch_still_stores_its_shards(tmp_path, cold_blocks):
    """An iterator abandoned after one batch held the node's download lock of every shard it had opened,
    with no completion started: no process of the node ever stored them, and every later pass read them
    block by block (the warm benchmark ran at cold speed). Closing the handles now completes and stores
    them, so the next pass on the node is warm: no ranged read, no download, every sample once."""
    import gc

    from shardkit.loaders.dataset import StreamingDataset

    url, cache = str(tmp_path / "ds"), str(tmp_path / "cache")
    write_blocks(url, 480, per_shard=240)
    first = StreamingDataset(url, cache_dir=cache, batch_size=4, shuffle_window=400)
    iterator = iter(first)
    next(iterator)
    del iterator  # abandoned, as by `next(iter(loader))`
    gc.collect()
    for shard_cache in first.caches:
        shard_cache.drain(30)
    second = StreamingDataset(url, cache_dir=cache, batch_size=4, shuffle_window=400)
    ids = np.concatenate([batch["sample_id"].numpy() for batch in second])
    stats = second.caches[0].stats
    assert (stats.range_reads, stats.downloads, stats.hits) == (0, 0, 2), stats
    assert sorted(ids.tolist()) == list(range(480))


def test_a_corrupt_block_refuses_the_whole_shard_for_every_later_read(tmp_path, cold_blocks):
    """Once a block failed its check twice, the shard is refused: a later read of intact samples raises
    too (the corruption stays reported), and the shard is never completed nor stored."""
    url = str(tmp_path / "ds")
    manifest = write_blocks(url, 240)
    shard = manifest.shards[0]
    bad = block_index(url, shard).blocks[5]
    flip_byte(url, shard.name, (bad.byte_start + bad.byte_end) // 2)
    cache = cache_module.ShardCache(Storage(url), manifest, str(tmp_path / "cache"))
    handle = cache.open(0, on_demand=True)
    with pytest.raises(CorruptShardError, match=rf"{shard.name}: block 5 "):
        handle.ensure([bad.sample_start])
    for _ in range(2):  # the second read is the one that would start the background completion
        with pytest.raises(CorruptShardError, match=rf"{shard.name}: block 5 "):
            handle.ensure([0])
    handle.close()
    cache.drain(30)
    assert not handle.complete and not cache.is_cached(0)


def count_reads(monkeypatch) -> list[tuple[int, int]]:
    """Record the (start, end) of every ranged read of a shard, by either read path."""
    reads: list[tuple[int, int]] = []
    read_range, read_range_into = Storage.read_range, Storage.read_range_into

    def counting(self, name, start, end):
        reads.append((start, end))
        return read_range(self, name, start, end)

    def counting_into(self, name, start, end, scratch):
        reads.append((start, end))
        return read_range_into(self, name, start, end, scratch)

    monkeypatch.setattr(Storage, "read_range", counting)
    monkeypatch.setattr(Storage, "read_range_into", counting_into)
    return reads


def test_every_cache_mode_yields_the_decoded_stream_and_resumes(tmp_path, cold_blocks):
    """Each mode, cold and warm, gives exactly "decoded"'s batches; resuming on a fresh node (a new cache
    directory per loader) continues them exactly; "none" leaves no file in its cache directory."""
    from shardkit.loaders.dataloader import StreamingDataLoader
    from shardkit.loaders.dataset import StreamingDataset

    url, reference = str(tmp_path / "ds"), str(tmp_path / "v1")
    write_blocks(url, 480, per_shard=120)
    write_blocks(reference, 480, per_shard=120, format_version=1)  # read whole, as before format v2

    def run(mode: str, cache: str, source: str = url) -> list[np.ndarray]:
        dataset = StreamingDataset(source, cache_dir=cache, shuffle_window=200, cache_mode=mode)
        return [np.concatenate([b["sample_id"].numpy(), b["tokens"].numpy().ravel(), b["cu_seqlens"].numpy(),
                                b["padding_segments"].numpy()])
                for b in StreamingDataLoader(dataset, batch_size=8)]

    want = run("decoded", str(tmp_path / "reference"), reference)
    fresh = itertools.count()
    for mode in CACHE_MODES:
        cache = str(tmp_path / f"cache-{mode}")
        for _ in range(2):  # cold, then warm
            got = run(mode, cache)
            assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want)), mode

        def make_loader(rank: int, world_size: int, mode=mode):
            dataset = StreamingDataset(url, cache_dir=str(tmp_path / f"node-{mode}-{next(fresh)}"), rank=rank,
                                       world_size=world_size, shuffle_window=200, cache_mode=mode)
            return StreamingDataLoader(dataset, batch_size=4)

        check_resume(make_loader, world_size=2)
        if mode == "none":
            left = [os.path.join(top, name) for top, _, names in os.walk(tmp_path)
                    if "none" in os.path.relpath(top, tmp_path) for name in names]
            assert left == [], left


def test_variable_length_samples_stream_block_by_block(tmp_path, cold_blocks):
    """Variable-length shards (offsets known only once a block is decoded) give the decoded stream."""
    from shardkit.loaders.dataset import StreamingDataset

    rng = np.random.default_rng(3)
    samples = [fixed_sample(i, int(rng.integers(3, 90))) for i in range(300)]
    for version in (1, 2):
        write_dataset(str(tmp_path / f"v{version}"), samples, seq_len=None, packing="none", max_samples=300,
                      tokenizer=TokenizerInfo(kind="byte", name="test", vocab_size=VOCAB, pad_id=0),
                      block_bytes=BLOCK_BYTES, format_version=version)

    def run(version: int, mode: str) -> list[np.ndarray]:
        dataset = StreamingDataset(str(tmp_path / f"v{version}"), cache_dir=str(tmp_path / mode), batch_size=4,
                                   shuffle_window=300, cache_mode=mode)
        return [np.concatenate([b["sample_id"].numpy(), b["lengths"].numpy(), b["tokens"].numpy().ravel()])
                for b in dataset]

    want, got = run(1, "decoded"), run(2, "none")
    assert len(got) == len(want) == 75 and all(np.array_equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("mode", ["decoded", "compressed"])
def test_cache_stats_of_a_shard_read_block_by_block(tmp_path, cold_blocks, mode):
    """Every ranged read is counted once with its bytes; the background completion counts one download.
    Each byte read is read once: the index and the blocks, plus the gaps between them (format headers and
    padding) only where the file itself is stored."""
    from shardkit.loaders.cache.shard_cache import ShardCache

    url = str(tmp_path / "ds")
    manifest = write_blocks(url, 240)
    shard = manifest.shards[0]
    blocks = block_index(url, shard).blocks
    used = shard.index_bytes + sum(b.byte_end - b.byte_start for b in blocks)
    assert used < shard.compressed_bytes
    cache = ShardCache(Storage(url), manifest, str(tmp_path / "cache"), cache_mode=mode)
    handle = cache.open(0, on_demand=True)
    assert not handle.complete
    handle.ensure([0])
    reads = cache.stats.range_reads
    assert reads == 2 and cache.stats.downloads == 0  # the index, then the first block
    handle.ensure([shard.samples - 1])  # the second request starts the background completion
    assert handle.partial.wait_complete(30)
    handle.close()
    cache.drain()
    assert cache.stats.downloads == 1
    assert cache.stats.downloaded_bytes == (shard.compressed_bytes if mode == "compressed" else used)
    assert cache.is_cached(0)


@pytest.mark.parametrize("mode", ["decoded", "compressed"])
def test_a_first_batch_reads_blocks_once_and_places_none(tmp_path, cold_blocks, mode):
    """A first batch's samples come from their decoded blocks, none placed into the shard's arrays (first
    touches of a whole-shard array cost as much as the decode); the completion places those blocks later
    without reading or decoding them again: every byte of the shard is read once, and the stored shard is whole."""
    from shardkit.loaders.cache.shard_cache import ShardCache

    url = str(tmp_path / "ds")
    manifest = write_blocks(url, 240)
    shard = manifest.shards[0]
    blocks = block_index(url, shard).blocks
    used = shard.index_bytes + sum(b.byte_end - b.byte_start for b in blocks)
    cache = ShardCache(Storage(url), manifest, str(tmp_path / "cache"), cache_mode=mode)
    handle = cache.open(0, on_demand=True)
    wanted = [200, 3, 117, 118]  # three blocks, in no order
    samples = handle.request_samples(wanted)()
    assert [ids_from_tokens(s.tokens.reshape(1, -1))[0] for s in samples] == wanted
    partial = handle.partial
    assert set(partial._decoded) == set(partial._index.blocks_of(wanted))
    assert block_reader_module._DONE not in partial._state  # nothing placed into the shard's arrays
    decoded = [0] * len(blocks)
    original = shard_bytes_module.decode_block

    def counting(data, block, *, number, **kwargs):
        decoded[number] += 1
        return original(data, block, number=number, **kwargs)

    shard_blocks_module.decode_block = counting
    try:
        handle.ensure([0])  # the second read starts the completion
        assert partial.wait_complete(30)
    finally:
        shard_blocks_module.decode_block = original
    handle.close()
    cache.drain()
    assert [k for k, count in enumerate(decoded) if count != 1] == partial._index.blocks_of(wanted)
    assert cache.stats.downloaded_bytes == (shard.compressed_bytes if mode == "compressed" else used)
    stored = cache.open(0)
    np.testing.assert_array_equal(ids_from_tokens(stored.reader.arrays.tokens.reshape(-1, SEQ + 1)), np.arange(240))
    stored.close()


def test_a_cold_first_batch_over_streams_with_and_without_document_boundaries(tmp_path, cold_blocks):
    """A mixture of a stream that stores document boundaries and one that does not: the batches carry none, and
    the first batch, gathered from its cold blocks, is the one a warm cache gives."""
    from shardkit.loaders.dataloader import StreamingDataLoader
    from shardkit.loaders.dataset import StreamingDataset
    from shardkit.loaders.order.mixing import Stream

    with_docs, without = str(tmp_path / "docs"), str(tmp_path / "plain")
    write_fixed(with_docs, 200, seq_len=16, per_shard=100, shard_format="arrow")
    write_fixed(without, 200, seq_len=16, per_shard=100, docs=False, shard_format="arrow", offset=200)

    def batches(cache: str) -> list[dict]:
        dataset = StreamingDataset([Stream(with_docs, 1.0), Stream(without, 1.0)], cache_dir=cache)
        return list(StreamingDataLoader(dataset, batch_size=8))

    cold = batches(str(tmp_path / "cache"))
    warm = batches(str(tmp_path / "cache"))
    assert "cu_seqlens" not in cold[0] and len(cold) == len(warm) == 50
    for got, want in zip(cold, warm):
        np.testing.assert_array_equal(got["tokens"].numpy(), want["tokens"].numpy())
        np.testing.assert_array_equal(ids_from_tokens(got["tokens"]), got["sample_id"].numpy())
