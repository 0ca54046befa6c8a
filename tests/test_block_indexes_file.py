"""`shardkit.blocks`, the shards' block indexes beside the manifest (issue 47, item 3): the build writes it, the
node cache fetches it with the manifest, and a cold shard's first read then needs no round trip for its index.

Locally: what the build writes (byte for byte each shard's own index), the size bound, a damaged file. On S3 (moto
on loopback, obstore): a first batch reads no block index when the file came with the manifest, and reads them
as before without it (an older dataset), with the same order and samples; an edited file costs round trips, never
a wrong sample; a manifest that lies about a shard's blocks (its index, in the file, made to match) is refused
with an error naming the shard.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import pytest

from loader_helpers import VOCAB, fixed_sample, ids_from_tokens

import shardkit.block_indexes as block_indexes_module
import shardkit.loaders.cache.shard_cache as cache_module
from shardkit import StreamingDataLoader, StreamingDataset
from shardkit.block_indexes import BLOCK_INDEXES_NAME, BlockIndexes, encode_block_indexes
from shardkit.errors import CorruptShardError
from shardkit.formats import write_dataset
from shardkit.formats.blocks import BlockIndex
from shardkit.manifest import MANIFEST_NAME, Manifest, TokenizerInfo, load_manifest
from shardkit.storage import Storage

PER_SHARD = 64


def write_blocks_dataset(url: str, *, shard_format: str = "tar", samples: int = 256) -> Manifest:
    """Shards of 64 samples of 65 tokens in blocks of about 8 samples (so a batch reads a few blocks a shard)."""
    return write_dataset(url, (fixed_sample(i, 65) for i in range(samples)),
                         tokenizer=TokenizerInfo(kind="byte", name="test", vocab_size=VOCAB), seq_len=64,
                         packing="concat", shard_format=shard_format, max_samples=PER_SHARD, block_bytes=1024)


def own_index(root: str, shard) -> bytes:
    with open(os.path.join(root, shard.name), "rb") as fh:
        fh.seek(shard.index_offset)
        return fh.read(shard.index_bytes)


@pytest.mark.parametrize("shard_format", ["tar", "arrow"])
def test_the_build_writes_each_shards_own_block_index_beside_the_manifest(tmp_path, shard_format):
    url = str(tmp_path / "data")
    manifest = write_blocks_dataset(url, shard_format=shard_format)
    data = Path(url, BLOCK_INDEXES_NAME).read_bytes()
    indexes = BlockIndexes.from_bytes(data, source=BLOCK_INDEXES_NAME)
    assert len(indexes) == len(manifest.shards) == 4
    for shard in manifest.shards:
        assert indexes.get(shard) == own_index(url, shard)
        assert len(BlockIndex.from_bytes(indexes.get(shard), shard=shard.name, samples=shard.samples,
                                         tokens=shard.tokens, raw_bytes=shard.raw_bytes,
                                         index_offset=shard.index_offset).blocks) > 4
    assert load_manifest(url) == manifest  # the JSON is unchanged by it


def test_indexes_past_the_bound_are_not_written_and_an_earlier_file_is_removed(tmp_path, monkeypatch):
    url = str(tmp_path / "data")
    write_blocks_dataset(url)
    assert Path(url, BLOCK_INDEXES_NAME).exists()
    monkeypatch.setattr(block_indexes_module, "MAX_BLOCK_INDEXES_BYTES", 1000)  # less than the four indexes
    write_blocks_dataset(url, samples=200)
    assert not Path(url, BLOCK_INDEXES_NAME).exists(), "a file made for the earlier shards was left behind"


def test_a_damaged_file_gives_only_indexes_that_match_the_manifest(tmp_path, caplog):
    url = str(tmp_path / "data")
    manifest = write_blocks_dataset(url)
    data = Path(url, BLOCK_INDEXES_NAME).read_bytes()
    first, second = manifest.shards[0], manifest.shards[1]
    cut = BlockIndexes.from_bytes(data[:len(data) - 5], source="cut")
    assert cut.get(manifest.shards[0]) == own_index(url, manifest.shards[0])
    assert cut.get(manifest.shards[-1]) is None  # its bytes were cut short
    assert "cut is damaged" in caplog.text
    flipped = bytearray(data)
    flipped[8 + 16 + 3] ^= 1  # in the first index's first entry
    flipped = BlockIndexes.from_bytes(bytes(flipped), source="flipped")
    assert flipped.get(first) is None and flipped.get(second) == own_index(url, second)
    assert len(BlockIndexes.from_bytes(b"NOTMAGIC" + data[8:], source="other")) == 0
    v1 = dataclasses.replace(first, index_offset=None, index_bytes=None, index_sha256=None)
    assert BlockIndexes.from_bytes(data, source="file").get(v1) is None


# -- on S3 -----------------------------------------------------------------------------------------------------
@pytest.fixture
def s3_dataset(s3_bucket, tmp_path, monkeypatch):
    """(url, storage_options, the local build it was uploaded from) of a dataset on moto read through obstore, every
    cold shard read block by block."""
    pytest.importorskip("obstore")
    monkeypatch.delenv("SHARDKIT_STORAGE_CLIENT", raising=False)
    monkeypatch.setattr(cache_module, "WHOLE_READ_BYTES", 0)
    url, options = s3_bucket
    local = str(tmp_path / "build")
    write_blocks_dataset(local)
    return url, options, local


def upload(local: str, url: str, options: dict, *, skip: tuple[str, ...] = (), replace: dict | None = None) -> None:
    storage = Storage(url, options)
    for name in sorted(os.listdir(local)):
        if name not in skip:
            storage.write_bytes(name, (replace or {}).get(name) or Path(local, name).read_bytes())


def first_batch(url: str, options: dict, cache_dir: str, *, epoch: bool = False):
    """(sample ids of the first batch, or of the whole epoch; the cache's ranged reads after the first batch;
    the loader's state after it)."""
    dataset = StreamingDataset(url, cache_dir=cache_dir, rank=0, world_size=1, storage_options=options,
                               seed=3, prefetch=False)
    loader = StreamingDataLoader(dataset, batch_size=8)
    batches = iter(loader)
    try:
        ids = [ids_from_tokens(next(batches)["tokens"]).tolist()]
        reads = dataset.caches[0].stats.range_reads
        state = loader.state_dict()
        if epoch:
            ids += [ids_from_tokens(batch["tokens"]).tolist() for batch in batches]
    finally:
        batches.close()
        dataset.caches[0].drain()  # no completion left reading when the test's server stops
    return ids, reads, state


def test_a_cold_first_batch_reads_no_block_index_when_the_file_came_with_the_manifest(s3_dataset, tmp_path):
    url, options, local = s3_dataset
    upload(local, url, options, skip=(BLOCK_INDEXES_NAME,))  # a dataset built before the file
    without, reads_without, state_without = first_batch(url, options, str(tmp_path / "old"), epoch=True)
    Storage(url, options).write_bytes(BLOCK_INDEXES_NAME, Path(local, BLOCK_INDEXES_NAME).read_bytes())
    held, reads_held, state_held = first_batch(url, options, str(tmp_path / "new"), epoch=True)
    assert held == without and state_held == state_without  # the same order, samples and state
    assert sorted(i for batch in held for i in batch) == list(range(256))
    shards_touched = len({i // PER_SHARD for i in held[0]})
    # Without the file every shard the first batch touches costs one ranged read more: its index.
    assert reads_without - reads_held == shards_touched > 1, (reads_without, reads_held, held[0])


def test_an_edited_file_costs_round_trips_never_a_wrong_sample(s3_dataset, tmp_path, caplog):
    url, options, local = s3_dataset
    data = bytearray(Path(local, BLOCK_INDEXES_NAME).read_bytes())
    manifest = load_manifest(local)
    # Each index's first entry's byte_end moved by one: well-formed indexes, none of them the manifest's.
    position = 8
    for shard in manifest.shards:
        data[position + 16 + 8] ^= 1
        position += shard.index_bytes
    upload(local, url, options, replace={BLOCK_INDEXES_NAME: bytes(data)})
    edited, reads_edited, _ = first_batch(url, options, str(tmp_path / "edited"), epoch=True)
    Storage(url, options).delete(BLOCK_INDEXES_NAME)
    plain, reads_plain, _ = first_batch(url, options, str(tmp_path / "plain"), epoch=True)
    assert edited == plain and reads_edited == reads_plain  # every index read from its shard, as without the file


def _lying_index(index: bytes, shard) -> bytes:
    """`index` with its first two blocks' shared boundary moved by one byte: still tiling the shard, so only
    the blocks' own SHA-256 can tell."""
    parsed = BlockIndex.from_bytes(index, shard=shard.name, samples=shard.samples, tokens=shard.tokens,
                                   raw_bytes=shard.raw_bytes, index_offset=shard.index_offset)
    blocks = list(parsed.blocks)
    blocks[0] = dataclasses.replace(blocks[0], byte_end=blocks[0].byte_end + 1)
    blocks[1] = dataclasses.replace(blocks[1], byte_start=blocks[1].byte_start + 1)
    return BlockIndex(tuple(blocks)).to_bytes()


def _manifest_vouching_for(manifest: Manifest, indexes: dict[int, bytes]) -> bytes:
    shards = [dataclasses.replace(s, index_sha256=hashlib.sha256(indexes[i]).hexdigest(), index_bytes=len(indexes[i]))
              if i in indexes else s for i, s in enumerate(manifest.shards)]
    return manifest.with_shards(shards).to_json().encode()


def test_a_manifest_that_lies_about_a_shards_blocks_is_refused_naming_the_shard(s3_dataset, tmp_path):
    url, options, local = s3_dataset
    manifest = load_manifest(local)
    lies = {i: _lying_index(own_index(local, s), s) for i, s in enumerate(manifest.shards)}
    upload(local, url, options, replace={MANIFEST_NAME: _manifest_vouching_for(manifest, lies),
                                         BLOCK_INDEXES_NAME: encode_block_indexes(lies.values())})
    with pytest.raises(CorruptShardError, match=r"s3://.*/shard-\d+\.tar.*block [01] \(bytes .*sha256"):
        first_batch(url, options, str(tmp_path / "lied"), epoch=True)


def test_an_index_that_does_not_tile_its_shard_is_refused_naming_the_shard(s3_dataset, tmp_path):
    url, options, local = s3_dataset
    manifest = load_manifest(local)
    shard = manifest.shards[0]
    parsed = BlockIndex.from_bytes(own_index(local, shard), shard=shard.name, samples=shard.samples,
                                   tokens=shard.tokens, raw_bytes=shard.raw_bytes, index_offset=shard.index_offset)
    short = BlockIndex(parsed.blocks[:-1]).to_bytes()  # the last block's samples left out
    lies = {i: short if i == 0 else own_index(local, s) for i, s in enumerate(manifest.shards)}
    upload(local, url, options, replace={MANIFEST_NAME: _manifest_vouching_for(manifest, lies),
                                         BLOCK_INDEXES_NAME: encode_block_indexes(lies.values())})
    with pytest.raises(CorruptShardError, match=rf"s3://.*/{shard.name}: block index covers"):
        first_batch(url, options, str(tmp_path / "short"), epoch=True)  # the epoch reads shard 0 too
