"""The resume contract (tests/resume_contract.py) for every loader mode: fixed-length (drop), pad, partial,
token budget, a mixture of Streams, one with a weight schedule and one whose weights changed mid-run
(allow_mixture_change), skip_samples, a quarantine list and shards quarantined during the run
(on_corrupt="skip"), shuffled blocks, each cache_mode and dense segment ids, without workers and with two
workers (persistent or not), and the dataset iterated on its own (its own state_dict); exact resume at every
save point with 2 ranks (on_corrupt="skip": 1, its ranks agree over a process group), and elastic resume to
another world size (modes whose state starts at the epoch's start)."""

from __future__ import annotations

import pytest

import json

from loader_helpers import write_fixed, write_variable
from resume_contract import check_elastic_resume, check_resume, stream_until, take
from shardkit import Stream, StreamingDataLoader, StreamingDataset
from shardkit.loaders.order.schedule import Schedule
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
    "blocks": ({"shuffle_window": 40, "seed": 3, "block_size": 10}, BATCH),
    # shard 1 of its source is damaged: found during the run, quarantined from there on (sources)
    "on_corrupt_skip": ({"shuffle_window": 40, "seed": 3, "on_corrupt": "skip", "chunk_samples": 24}, BATCH),
    # the mixture's weights change at a mid-epoch save; the contract holds for the run that continues
    "mixture_change": ({"shuffle_window": 30, "seed": 3, "epoch_size": 150}, BATCH),
    # StreamingDataset iterated on its own: its state_dict() and epoch (what StatefulDataLoader drives)
    "standalone": ({"shuffle_window": 40, "seed": 3}, BATCH),
}
WORLD = {"on_corrupt_skip": 1}  # ranks of the exact-resume check (default 2)
NOT_ELASTIC = {
    "on_corrupt_skip": "several ranks agree over a torch.distributed group (tests/test_quarantine.py)",
    "mixture_change": "its state starts mid-epoch (the elastic check counts from the epoch's start; test_remix)",
    "standalone": "each rank's dataset holds its own state (tests/test_standalone_resume.py)",
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
    damaged = str(root / "damaged")
    write_fixed(damaged, 139, seq_len=8, per_shard=32)
    path = root / "damaged" / load_manifest(damaged).shards[1].name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40  # every read of it fails its SHA-256, so every run quarantines it
    path.write_bytes(bytes(data))
    changed = [Stream(a, weight=1), Stream(b, weight=3)]
    sources = {mode: fixed for mode in MODES}
    return {**sources, "token_budget": variable, "mixture": mixture, "schedule": schedule, "mixture_change": changed,
            "on_corrupt_skip": damaged, "cache": str(root / "cache"), "quarantine_list": fixed,
            "listing": str(listing)}


def factory(sources, mode, num_workers=0, persistent_workers=False):
    dataset_kwargs, batch_size = MODES[mode]
    changes: dict[int, dict] = {}  # mixture_change: world size -> the state saved mid-epoch by the old mixture

    def make_loader(rank, world_size, source=None):
        extra = {"quarantine_list": sources["listing"]} if mode == "quarantine_list" else {}
        if mode == "standalone":
            return StreamingDataset(sources[mode], cache_dir=sources["cache"], rank=rank, world_size=world_size,
                                    batch_size=batch_size, **dataset_kwargs)
        dataset = StreamingDataset(source or sources[mode], cache_dir=sources["cache"], rank=rank,
                                   world_size=world_size, **dataset_kwargs, **extra)
        loader = StreamingDataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                                     persistent_workers=persistent_workers)
        if mode == "mixture_change" and source is None:
            if world_size not in changes:
                before = make_loader(0, world_size, source=sources["mixture"])
                take(before, 5)
                changes[world_size] = before.state_dict()
            loader.load_state_dict(changes[world_size], allow_mixture_change=True)
        return loader
    return make_loader


@pytest.mark.parametrize(("num_workers", "persistent_workers"), WORKERS)
@pytest.mark.parametrize("mode", list(MODES))
def test_exact_resume_at_every_save_point(sources, mode, num_workers, persistent_workers):
    if mode == "standalone" and num_workers:
        pytest.skip("torch DataLoader workers around the dataset: tests/test_standalone_resume.py")
    make = factory(sources, mode, num_workers, persistent_workers)
    figures = check_resume(make, world_size=WORLD.get(mode, 2))
    assert figures["steps"] > figures["steps_per_epoch"] >= 4
    # The contract ran over what the mode is about: a shard quarantined mid-run, a recorded mixture change.
    if mode == "on_corrupt_skip":
        run = make(0, 1)
        stream_until(run, 1)
        assert [entry[0] for entry in run.state_dict()["quarantine"]] == [1]
    if mode == "mixture_change":
        change = make(0, 2).state_dict()["mixture"]["changes"]
        assert len(change) == 1 and change[0]["step"] == 5, change


@pytest.mark.parametrize(("before", "after", "num_workers"),
                         [(2, 3, 0), pytest.param(3, 1, 2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode", [mode for mode in MODES if mode not in NOT_ELASTIC])
def test_elastic_resume_continues_the_global_order(sources, mode, before, after, num_workers):
    make = factory(sources, mode, num_workers)
    check_elastic_resume(make, before=before, after=after, token_budget=mode == "token_budget")
