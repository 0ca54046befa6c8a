"""benchmarks/side_by_side.py (issue 36's table): its exactness checks catch a reader that loses, repeats or
fails to resume, on shardkit and on the peers that are installed, and the table's ratios favour the right side."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_loader  # noqa: E402
import peers  # noqa: E402
import side_by_side as bench  # noqa: E402

SAMPLES = 70  # not a multiple of the batch: the ragged end is part of every sample once
BATCH = 8


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The benchmark's samples, small: shardkit tar shards and the flat copy the peers are written from."""
    root = tmp_path_factory.mktemp("side")
    url, flat, samples = bench_loader.build_data(root, SAMPLES * (bench_loader.SEQ + 1), 64 << 10)
    assert samples == SAMPLES
    return root, url, flat


def test_a_pass_is_exact_only_when_every_sample_comes_once(data):
    _, url, _ = data
    make = bench.shardkit_factory(None)(url, BATCH)
    assert bench.one_pass(make, SAMPLES)["exact"]

    def dropping_the_ragged_end(cache: str):
        from shardkit import StreamingDataLoader, StreamingDataset

        return StreamingDataLoader(StreamingDataset(url, cache_dir=cache, rank=0, world_size=1), batch_size=BATCH)

    assert not bench.one_pass(dropping_the_ragged_end, SAMPLES)["exact"]
    assert not bench._exact(np.r_[np.arange(SAMPLES - 1), 0], SAMPLES)  # one repeated, one missing


def test_a_resume_is_exact_only_when_the_state_is_honoured(data):
    _, url, _ = data
    make = bench.shardkit_factory(None)(url, BATCH)
    row = bench.resumed_first_batch(make, SAMPLES, BATCH, to_the_end=True)
    assert row["exact"] and row["first_batch_s"] > 0

    def forgetting(cache: str):
        loader = make(cache)
        loader.load_state_dict = lambda state: None  # starts the epoch over: the first half comes twice
        return loader

    assert not bench.resumed_first_batch(forgetting, SAMPLES, BATCH, to_the_end=True)["exact"]

    def failing(cache: str):  # as Hugging Face's stream under 2 workers did: the run goes on, the cell says so
        loader = make(cache)
        loader.load_state_dict = lambda state: [][0]
        return loader

    row = bench.measure("failing", failing, SAMPLES, BATCH, 1, resume=True)
    assert row["exact"] and row["resume_error"].startswith("IndexError")
    table = bench.table({"cells": {"shardkit Arrow": {"local, workers=0": row}, "shardkit tar": {}}})
    assert "| first batch after resume (s), local, 0 workers | fails |" in table


@pytest.mark.parametrize("peer", ["webdataset", "datasets", "litdata"])
def test_each_installed_peer_delivers_every_sample_once_and_resumes(data, peer):
    pytest.importorskip(peer)
    root, _, flat = data
    built = peers.build_peers(root, flat, SAMPLES, bench_loader.SEQ + 1, 64 << 10, which=(peer,),
                              litdata_compressions=("zstd",))
    (url, factory), = built.values()
    make = factory(url, BATCH, None, 0)
    assert bench.one_pass(make, SAMPLES)["exact"]
    if peer != "webdataset":  # it has no loader state
        assert bench.resumed_first_batch(make, SAMPLES, BATCH, to_the_end=True)["exact"]


def test_the_table_puts_shardkit_against_the_best_peer_of_each_column():
    def cell(rate, first, resumed=None):
        return {"samples_per_s": rate, "first_batch_s": first, "resume_first_batch_s": resumed, "exact": True,
                "resumed_exactly": True}

    cells = {"shardkit Arrow": {"local, workers=0": cell(300, 0.02, 0.01)},
             "shardkit tar": {"local, workers=0": cell(100, 0.05, 0.04)},
             "peer A": {"local, workers=0": cell(200, 0.04, 0.02)},
             "peer B": {"local, workers=0": cell(150, 0.01, None)}}
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in bench.table({"cells": cells}).splitlines()}
    assert rows["samples/s, local, 0 workers"][-2:] == ["1.50x", "**0.50x** |"]  # against A's 200 samples/s
    # times: the best peer's over shardkit's (B's 0.01 s first batch; only A resumes)
    assert rows["first batch fresh (s), local, 0 workers"][-2:] == ["**0.50x**", "**0.20x** |"]
    assert rows["first batch after resume (s), local, 0 workers"][-2:] == ["2.00x", "**0.50x** |"]
    assert rows["samples/s, moto S3, 0 workers"][1] == "n/a"
