"""The resume contract (tests/resume_contract.py) for every loader mode: fixed-length (drop), pad, partial,
token budget, a mixture of Streams and one with a weight schedule, skip_samples, a quarantine list, each
cache_mode and dense segment ids, without workers and with two workers (persistent or not);
exact resume at every save point with 2 ranks, and elastic resume to another world size."""

from __future__ import annotations

import pytest

import json

from loader_helpers import write_fixed, write_variable
from resume_contract import check_elastic_resume, check_resume
from shardkit import Stream, StreamingDataLoader, StreamingDataset
from shardkit.loaders.schedule import Schedule
from shardkit.manifest import load_manifest
from shardkit.verify import QUARANTINE_KIND, QUARANTINE_VERSION

BATCH = 4
# name -> (dataset keyword arguments, batch_size); the sources are written once per module
MODES = {
    "fixed": ({"shuffle_window": 40, "seed": 3}, BATCH),
    "pad": ({"shuffle_window": 40, "seed": 3, "partial_batches": "pad"}, BATCH),
    "token_budget": ({"shuffle_window": 60, "seed": 3, "max_tokens": 96, "token_window": 50}, None),
    "mixture": ({"shuffle_window": 30, "seed": 3, "epoch_size": 150}, BATCH),
    # Issue 23: every mode, each an operator behind one contract (order, step source, store).
    "partial": ({"shuffle_window": 40, "seed": 3, "partial_batches": "partial"}, BATCH),
    "skip_samples": ({"shuffle_window": 40, "seed": 3, "skip_samples": "5-20,77 100-104"}, BATCH),
    "quarantine_list": ({"shuffle_window": 40, "seed": 3}, BATCH),  # + the list of one shard (sources)
    "schedule": ({"shuffle_window": 30, "seed": 3, "epoch_size": 150}, BATCH),
    "compressed": ({"shuffle_window": 40, "seed": 3, "cache_mode": "compressed"}, BATCH),
    "no_cache": ({"shuffle_window": 40, "seed": 3, "cache_mode": "none"}, BATCH),
    "segment_ids": ({"shuffle_window": 40, "seed": 3, "segment_ids": True}, BATCH),
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
    schedule = [Stream(a, weight=Schedule([(0, 1.0), (6, 3.0)])), Stream(b, weight=1)]
    shard = load_manifest(fixed).shards[1]
    listing = root / "quarantine.json"
    listing.write_text(json.dumps({"kind": QUARANTINE_KIND, "version": QUARANTINE_VERSION, "dataset": fixed,
                                   "shards": [{"name": shard.name, "sha256": shard.sha256}]}))
    sources = {mode: fixed for mode in MODES}
    return {**sources, "token_budget": variable, "mixture": mixture, "schedule": schedule,
            "cache": str(root / "cache"), "quarantine_list": fixed, "listing": str(listing)}


def factory(sources, mode, num_workers=0, persistent_workers=False):
    dataset_kwargs, batch_size = MODES[mode]

    def make_loader(rank, world_size):
        extra = {"quarantine_list": sources["listing"]} if mode == "quarantine_list" else {}
        dataset = StreamingDataset(sources[mode], cache_dir=sources["cache"], rank=rank, world_size=world_size,
                                   **dataset_kwargs, **extra)
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
