"""Shards encoded on every core the memory allows (issue 36 item 5), and the same bytes whatever the count."""

from __future__ import annotations

import pytest

from shardkit.formats import ShardWriter
from shardkit.manifest import MANIFEST_NAME
from shardkit.tools import build as build_module
from shardkit.tools import encode_threads as encode_threads_module
from shardkit.tools.build import run_build
from shardkit.tools.convert.config import ConvertConfig
from shardkit.tools.encode_threads import SHARD_COPIES, available_memory, choose_encode_threads
from test_build import config, write_corpus

MB = 10**6


def test_one_thread_per_core_when_memory_allows():
    assert choose_encode_threads(64 * MB, cores=64, memory=1 << 40) == 64
    assert choose_encode_threads(64 * MB, cores=2, memory=1 << 40) == 2


def test_memory_bounds_the_threads_and_leaves_at_least_one():
    # Half of 8 GiB at 3 x 64 MB a thread: 22 threads, not 64.
    assert choose_encode_threads(64 * MB, cores=64, memory=8 << 30) == (4 << 30) // (SHARD_COPIES * 64 * MB) == 22
    assert choose_encode_threads(1 << 30, cores=64, memory=1 << 30) == 1
    assert choose_encode_threads(64 * MB, cores=8, memory=None) == 8  # unknown memory: the cores decide


def test_an_explicit_count_is_taken_as_given():
    assert choose_encode_threads(64 * MB, 0, cores=64, memory=1 << 40) == 0
    assert choose_encode_threads(64 * MB, 5, cores=2, memory=1 << 20) == 5


def test_this_machine_has_a_memory_figure():
    assert available_memory() is not None and available_memory() > 0


def test_a_negative_count_names_the_option(tmp_path):
    with pytest.raises(ValueError, match="--encode-threads must be >= 0, got -1"):
        config([tmp_path], tmp_path / "out", encode_threads=-1)
    with pytest.raises(ValueError, match="--encode-threads must be >= 0, got -1"):
        ConvertConfig(inputs=("src",), source_format="megatron", output=str(tmp_path / "out"), seq_len=8,
                      encode_threads=-1)


class RecordingWriter(ShardWriter):
    """The real writer, noting the thread count the build gave it."""
    counts: list[int] = []

    def __init__(self, *args, **kwargs):
        RecordingWriter.counts.append(kwargs["encode_threads"])
        super().__init__(*args, **kwargs)


def test_same_shards_and_manifest_for_1_and_3_encode_threads(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "in", docs=200)
    monkeypatch.setattr(build_module, "ShardWriter", RecordingWriter)
    RecordingWriter.counts = []
    outputs = {}
    for threads in (1, 3):
        out = tmp_path / f"t{threads}"
        result = run_build(config([corpus], out, shard_size=5_000, encode_threads=threads))
        assert len(result.manifest.shards) > 6  # more shards than threads: several in flight at once
        outputs[threads] = {path.name: path.read_bytes() for path in out.iterdir() if path.is_file()}
    assert RecordingWriter.counts == [1, 3]
    assert MANIFEST_NAME in outputs[1]
    shard_names = [name for name in outputs[1] if name.startswith("shard-")]
    assert {name: outputs[1][name] for name in shard_names} == {name: outputs[3][name] for name in shard_names}
    assert outputs[1][MANIFEST_NAME] == outputs[3][MANIFEST_NAME]


def test_the_default_follows_the_machine(tmp_path, monkeypatch):
    """Without --encode-threads the build takes the count from the cores it may run on (here said to be 7)."""
    corpus = write_corpus(tmp_path / "in", docs=30, bad=False)
    monkeypatch.setattr(build_module, "ShardWriter", RecordingWriter)
    monkeypatch.setattr(encode_threads_module, "available_cores", lambda: 7)
    RecordingWriter.counts = []
    run_build(config([corpus], tmp_path / "out"))
    assert RecordingWriter.counts == [7]
