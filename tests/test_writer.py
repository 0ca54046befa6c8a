"""ShardWriter: bad samples, rollover by count and bytes, the after-shard hook, no partial shard, any fsspec URL."""

from __future__ import annotations

import numpy as np
import pytest
from format_samples import make_samples, read_back, tokenizer

from shardkit.formats import Sample, write_dataset
from shardkit.manifest import load_manifest
from shardkit.storage import Storage


def test_writer_rejects_bad_samples_at_once_and_keeps_going(tmp_path):
    from shardkit.formats import ShardWriter

    url = str(tmp_path / "ds")
    with ShardWriter(url, token_dtype="uint16", max_samples=2) as writer:
        writer.write(np.array([1, 2, 3]))
        with pytest.raises(ValueError, match=r"sample 1 of shard 0 \(written to .*ds\): token ids must be in"):
            writer.write(np.array([1, 70000]))
        with pytest.raises(ValueError, match="doc_starts must begin at 0"):
            writer.write(Sample(np.arange(4), np.array([1]), np.array([0]), np.array([0])))
        with pytest.raises(ValueError, match="equal length"):
            writer.write(Sample(np.arange(4), np.array([0, 2]), np.array([0]), np.array([0, 1])))
        with pytest.raises(ValueError, match="either store document boundaries or not"):
            writer.write(Sample(np.arange(4), np.array([0]), np.array([0]), np.array([0])))
        writer.write(np.array([4, 5]))
    assert [s.samples for s in writer.shards] == [2]  # the rejected samples were never buffered
    storage = Storage(url)
    from shardkit.formats import decode_shard

    arrays = decode_shard(storage.read_bytes(writer.shards[0].name), shard_format="tar", token_dtype="uint16",
                          shard="s", raw_bytes=writer.shards[0].raw_bytes)
    assert [arrays.sample(i).tokens.tolist() for i in range(2)] == [[1, 2, 3], [4, 5]]

def test_writer_rolls_over_by_max_samples(tmp_path):
    from shardkit.formats import ShardWriter

    with ShardWriter(str(tmp_path / "ds"), max_samples=4, max_bytes=None) as writer:
        for i in range(10):
            writer.write(np.full(7, i, dtype=np.uint16))
    assert [s.samples for s in writer.shards] == [4, 4, 2]
    assert [s.name for s in writer.shards] == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]

@pytest.mark.parametrize("shard_format", ["tar", "arrow"])
def test_writer_rolls_over_by_max_bytes(tmp_path, shard_format):
    from shardkit.formats import ShardWriter

    # 100 uint16 tokens = 200 payload bytes per sample: a shard closes once it holds >= 500 bytes.
    with ShardWriter(str(tmp_path / "ds"), shard_format=shard_format, max_bytes=500, max_samples=None,
                     name_template="part/{index:03d}", start_index=7) as writer:
        for i in range(10):
            writer.write(np.full(100, i, dtype=np.uint16))
    assert [s.samples for s in writer.shards] == [3, 3, 3, 1]
    assert writer.shards[0].name == f"part/007.{shard_format}" and writer.shards[-1].name == f"part/010.{shard_format}"
    assert Storage(str(tmp_path / "ds")).list_names() == sorted(s.name for s in writer.shards)

def test_on_shard_done_hook_sees_each_finished_shard_in_order(tmp_path):
    from shardkit.formats import ShardWriter

    storage = Storage(str(tmp_path / "ds"))
    seen = []

    def hook(info):
        # The shard is complete and readable when the hook runs.
        seen.append((info, storage.size(info.name)))

    with ShardWriter(storage, max_samples=3, on_shard_done=hook) as writer:
        for i in range(7):
            writer.write(np.arange(i, i + 5, dtype=np.uint16))
        assert len(seen) == 2  # the hook runs as shards fill, not only at the end
    assert [info for info, _ in seen] == writer.shards
    assert [size for _, size in seen] == [s.compressed_bytes for s in writer.shards]

def test_writer_does_not_publish_a_partial_shard_on_error(tmp_path):
    from shardkit.formats import ShardWriter

    url = str(tmp_path / "ds")
    with pytest.raises(RuntimeError, match="boom"):
        with ShardWriter(url, max_samples=3) as writer:
            for i in range(5):
                writer.write(np.full(4, i, dtype=np.uint16))
            raise RuntimeError("boom")
    assert Storage(url).list_names() == ["shard-000000.tar"]  # the full one only; 2 pending samples dropped

@pytest.mark.parametrize("shard_format", ["tar", "arrow"])
def test_write_dataset_to_memory_url(tmp_path, shard_format):
    import uuid

    url = f"memory://formats-{uuid.uuid4().hex[:8]}/ds"
    rng = np.random.default_rng(4)
    samples = make_samples(rng, 30, 50257, fixed=33)
    manifest = write_dataset(url, samples, tokenizer=tokenizer(50257), seq_len=32, packing="concat",
                             shard_format=shard_format, max_samples=8)
    assert load_manifest(url) == manifest
    assert [s.samples for s in manifest.shards] == [8, 8, 8, 6]
    direct, cached = read_back(url, manifest, tmp_path)
    for got in (direct, cached):
        assert len(got) == 30
        for want, have in zip(samples, got):
            np.testing.assert_array_equal(have.tokens, want.tokens)
            np.testing.assert_array_equal(have.doc_starts, want.doc_starts)


@pytest.mark.parametrize("limits", [dict(max_samples=7, max_bytes=None), dict(max_samples=None, max_bytes=1500),
                                    dict(max_samples=5, max_bytes=900)])
def test_write_arrays_rolls_over_at_the_same_samples_as_write(tmp_path, limits):
    """Runs of samples written at once (the build's packers hand the writer whole batches) give the same
    shards, byte for byte, as the samples written one by one, whatever the runs' sizes."""
    from shardkit.formats import ShardWriter, arrays_from_samples

    rng = np.random.default_rng(3)
    samples = []
    for _ in range(60):
        n = int(rng.integers(1, 90))
        cuts = np.unique(np.concatenate([[0], rng.integers(1, n, int(rng.integers(0, 3)))])) if n > 1 else np.array([0])
        samples.append(Sample(rng.integers(0, 60000, n), cuts, np.zeros(len(cuts), np.int32), np.arange(len(cuts))))
    with ShardWriter(str(tmp_path / "one"), shard_format="arrow", **limits) as one:
        for sample in samples:
            one.write(sample)
    with ShardWriter(str(tmp_path / "runs"), shard_format="arrow", **limits) as runs:
        start = 0
        for size in [1, 13, 0, 2, 30, 14]:
            runs.write_arrays(arrays_from_samples(samples[start:start + size], "uint32"))
            start += size
    assert len(one.shards) > 3 and one.shards == runs.shards
    with ShardWriter(str(tmp_path / "bad"), token_dtype="uint16") as bad:
        with pytest.raises(ValueError, match=r"samples 0-1 of shard 0 \(written to .*bad\): token ids must be in"):
            bad.write_arrays(arrays_from_samples([Sample(np.arange(3)), Sample(np.array([70000]))], "uint32"))
        broken = arrays_from_samples(samples[:2], "uint32")
        with pytest.raises(ValueError, match="first document segment does not start at 0"):
            bad.write_arrays(type(broken)(broken.tokens, broken.sample_offsets, broken.doc_offsets,
                                          broken.doc_starts + 1, broken.doc_source, broken.doc_index))


def test_background_encoding_gives_the_same_shards_and_reports_them_in_order(tmp_path):
    """With `encode_threads` shards are compressed and stored in threads while the next ones fill: the
    bytes are the same, `on_shard_cut` sees each shard when its samples are fixed (before it is stored)
    and `on_shard_done` sees them in order; a failed upload is raised to the writer's caller."""
    from shardkit.formats import ShardWriter

    samples = [np.arange(i, i + 200) % 5000 for i in range(80)]
    with ShardWriter(str(tmp_path / "serial"), shard_format="arrow", max_samples=9) as serial:
        for sample in samples:
            serial.write(sample)
    events = []
    with ShardWriter(str(tmp_path / "threads"), shard_format="arrow", max_samples=9, encode_threads=2,
                     on_shard_cut=lambda index: events.append(("cut", index)),
                     on_shard_done=lambda info: events.append(("done", info.name))) as threaded:
        for sample in samples:
            threaded.write(sample)
    assert threaded.shards == serial.shards and len(serial.shards) == 9
    done = [name for kind, name in events if kind == "done"]
    assert done == [s.name for s in serial.shards]
    for number, name in enumerate(done):  # each shard was cut before it was reported
        assert events.index(("cut", number)) < events.index(("done", name))

    class FailingStorage(Storage):
        def write_bytes(self, name, data):
            raise OSError(f"upload of {name} refused")

    with pytest.raises(OSError, match="upload of shard-000000.arrow refused"):
        with ShardWriter(FailingStorage(str(tmp_path / "failing")), shard_format="arrow", max_samples=9,
                         encode_threads=2) as failing:
            for sample in samples:
                failing.write(sample)
