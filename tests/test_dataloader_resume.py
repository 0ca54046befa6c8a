"""The resume contract (tests/resume_contract.py) for every loader mode: fixed-length (drop), pad,
token budget and a mixture of Streams, without workers and with two workers (persistent or not);
exact resume at every save point with 2 ranks, and elastic resume to another world size."""

from __future__ import annotations

import pytest

from loader_helpers import write_fixed, write_variable
from resume_contract import check_elastic_resume, check_resume
from shardkit import Stream, StreamingDataLoader, StreamingDataset

BATCH = 4
# name -> (dataset keyword arguments, batch_size); the sources are written once per module
MODES = {
    "fixed": ({"shuffle_window": 40, "seed": 3}, BATCH),
    "pad": ({"shuffle_window": 40, "seed": 3, "partial_batches": "pad"}, BATCH),
    "token_budget": ({"shuffle_window": 60, "seed": 3, "max_tokens": 96, "token_window": 50}, None),
    "mixture": ({"shuffle_window": 30, "seed": 3, "epoch_size": 150}, BATCH),
}
WORKERS = [pytest.param(0, False, id="workers0"),
           pytest.param(2, False, id="workers2", marks=pytest.mark.slow),
           pytest.param(2, True, id="workers2-persistent", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    fixed, variable, a, b = (str(root / n) for n in ("fixed", "variable", "a", "b"))
    write_fixed(fixed, 139, seq_len=8, per_shard=32)  # 139: a ragged tail for drop and pad
    write_variable(variable, 130, max_len=40, per_shard=30)
    write_fixed(a, 90, seq_len=8, per_shard=32)
    write_fixed(b, 37, seq_len=8, per_shard=16, offset=90)
    mixture = [Stream(a, weight=2), Stream(b, weight=1)]
    return {"fixed": fixed, "pad": fixed, "token_budget": variable, "mixture": mixture,
            "cache": str(root / "cache")}


def factory(sources, mode, num_workers=0, persistent_workers=False):
    dataset_kwargs, batch_size = MODES[mode]

    def make_loader(rank, world_size):
        dataset = StreamingDataset(sources[mode], cache_dir=sources["cache"], rank=rank, world_size=world_size,
                                   **dataset_kwargs)
        return StreamingDataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                                   persistent_workers=persistent_workers)
    return make_loader


@pytest.mark.parametrize(("num_workers", "persistent_workers"), WORKERS)
@pytest.mark.parametrize("mode", list(MODES))
def test_exact_resume_at_every_save_point(sources, mode, num_workers, persistent_workers):
    figures = check_resume(factory(sources, mode, num_workers, persistent_workers), world_size=2)
    assert figures["steps"] > figures["steps_per_epoch"] >= 4


@pytest.mark.parametrize(("before", "after", "num_workers"),
                         [(2, 3, 0), pytest.param(3, 1, 2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode", list(MODES))
def test_elastic_resume_continues_the_global_order(sources, mode, before, after, num_workers):
    make = factory(sources, mode, num_workers)
    check_elastic_resume(make, before=before, after=after, token_budget=mode == "token_budget")
