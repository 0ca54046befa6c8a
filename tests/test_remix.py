"""Mixture changes mid-run and weight schedules: exact (no sample of a stream's current epoch repeated),
the new proportions within the stated tolerance from the change on, elastic, recorded, and opt-in only."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from conftest import free_port
from loader_helpers import ids_from_tokens, write_fixed
from loader_procs import loader_run
from shardkit import StreamingDataLoader, StreamingDataset
from shardkit.loaders.order.mixing import MIX_PERIOD, Stream, mixture_quotas
from shardkit.loaders.order.epochs import EpochOrder, OrderConfig
from shardkit.loaders.order.schedule import Schedule
from shardkit.train.config import data_entries

BATCH = 4
EPOCH = 800  # positions per mixture epoch; no stream completes its own epoch inside one (no legit repeats)
ORDER = {"seed": 5, "shuffle_window": 50, "epoch_size": EPOCH}


@pytest.fixture(scope="module")
def streams(tmp_path_factory):
    """Three datasets whose tokens encode ids 0-599 (a), 600-1199 (b), 1200-1499 (c)."""
    root = tmp_path_factory.mktemp("remix")
    urls = {"a": str(root / "a"), "b": str(root / "b"), "c": str(root / "c")}
    write_fixed(urls["a"], 600, per_shard=50)
    write_fixed(urls["b"], 600, per_shard=50, offset=600)
    write_fixed(urls["c"], 300, per_shard=50, offset=1200)
    return urls, str(root / "cache")


def stream_of(ids: np.ndarray) -> np.ndarray:
    """Which dataset a sample came from, from the id its tokens encode (stable across mixtures)."""
    return np.searchsorted([600, 1200], ids, side="right")


def make_loader(streams, weights: dict, *, rank=0, world=1, batch=BATCH, **options):
    urls, cache = streams
    source = [Stream(urls[name], weight=w) for name, w in weights.items()]
    dataset = StreamingDataset(source, cache_dir=cache, rank=rank, world_size=world, **{**ORDER, **options})
    return StreamingDataLoader(dataset, batch_size=batch)


def run_ranks(streams, weights, *, world, steps=None, state=None, allow=False, batch=BATCH, **options):
    """Every rank of `world` in this process (explicit ranks): per rank, the token ids of each batch; the state."""
    per_rank, states = [], []
    for rank in range(world):
        loader = make_loader(streams, weights, rank=rank, world=world, batch=batch, **options)
        if state is not None:
            loader.load_state_dict(state, allow_mixture_change=allow)
        per_rank.append([ids_from_tokens(b["tokens"]) for b in itertools.islice(loader, steps)])
        states.append(loader.state_dict())
    assert all(s == states[0] for s in states), "the state must be global"
    return per_rank, states[0]


def step_unions(per_rank) -> list[np.ndarray]:
    """Per global step, the ids of all ranks (the positions of that step, in id order)."""
    return [np.sort(np.concatenate(batches)) for batches in zip(*per_rank)]


def blocks(steps: list[np.ndarray], size: int) -> list[np.ndarray]:
    """The ids of consecutive runs of `size` positions (whole steps), sorted: comparable across world sizes."""
    flat = np.concatenate(steps)
    return [np.sort(flat[i:i + size]) for i in range(0, len(flat) - size + 1, size)]


def own_order(name: str, seed_key: int, count: int, state: dict) -> list[int]:
    """The first `count` items of a stream's own endless order (its reshuffled epochs, seeded by its key),
    as the ids its tokens encode: what the mixture must have taken from it, whatever the changes."""
    size, first = {"a": (600, 0), "b": (600, 600), "c": (300, 1200)}[name]
    order = state["order"]
    config = OrderConfig(seed=order["seed"] + 1_000_003 * seed_key, num_partitions=order["num_partitions"],
                         shuffle_window=order["shuffle_window"])
    ids = [EpochOrder([50] * (size // 50), config, e).sample_ids(np.arange(size)) for e in range(-(-count // size))]
    return sorted((np.concatenate(ids)[:count] + first).tolist())


def check_streams_continue(ids: np.ndarray, seed_keys: dict[str, int], state: dict) -> None:
    """Every stream gave exactly the next items of its own order: nothing repeated, nothing skipped."""
    for name, key in seed_keys.items():
        mine = ids[stream_of(ids) == "abc".index(name)]
        assert sorted(mine.tolist()) == own_order(name, key, len(mine), state), f"stream {name} left its order"


def check_within_tolerance(steps: list[np.ndarray], weights: dict[str, float], what: str) -> None:
    """Each step is a run of consecutive positions: stream counts within +-max(1, k - 1) of their quota."""
    quotas = mixture_quotas(list(weights.values()))
    present = ["abc".index(name) for name in weights]
    for i, ids in enumerate(steps):
        counts = np.bincount(stream_of(ids), minlength=3)[present]
        assert counts.sum() == len(ids), f"{what}: step {i} holds a stream outside the mixture"
        assert np.all(np.abs(counts - len(ids) * quotas / MIX_PERIOD) <= max(1, len(weights) - 1) + 1e-9), \
            f"{what}: step {i} takes {counts.tolist()} of {len(ids)}, quotas {quotas.tolist()}"


@pytest.mark.slow
def test_reweight_mid_epoch_on_two_ranks_then_three_is_exact(process_pool, streams):
    urls, cache = streams
    options = {"dataset_kwargs": ORDER}

    def group(weights, world, **kwargs):
        port, source = free_port(), [Stream(urls[n], weight=w) for n, w in weights.items()]
        return process_pool.run(loader_run, [dict(url=source, cache_dir=cache, batch_size=BATCH, rank=r,
                                                  world_size=world, port=port, **options, **kwargs)
                                             for r in range(world)])

    before = group({"a": 0.5, "b": 0.5}, 2, limit=40)  # 320 positions, mid-epoch
    state = before[0]["state"]
    assert state["position"]["samples"] == 320
    after = group({"a": 0.9, "b": 0.1}, 3, state=state, allow_mixture_change=True, limit=15)
    assert all(r["mismatched"] == 0 for r in after) and after[0]["steps_per_rank"] == [15] * 3
    changed = after[0]["state"]
    assert all(r["state"] == changed for r in after)
    assert changed["position"]["samples"] == 320 + 15 * 12
    assert changed["mixture"]["changes"] == [{"step": 40, "epoch": 0, "position": 320,
                                              "old": [[urls["a"], 0.5], [urls["b"], 0.5]],
                                              "new": [[urls["a"], 0.9], [urls["b"], 0.1]]}]
    # The rest of the epoch, elastically on 2 ranks and on 3 ranks (same new mixture: no opt-in needed).
    rest2, end = run_ranks(streams, {"a": 0.9, "b": 0.1}, world=2, state=changed)
    rest3, _ = run_ranks(streams, {"a": 0.9, "b": 0.1}, world=3, state=changed)
    assert end["position"]["epoch"] == 1 and end["mixture"]["changes"] == changed["mixture"]["changes"]
    assert [b.tolist() for b in blocks(step_unions(rest2), 24)] == [b.tolist() for b in blocks(step_unions(rest3), 24)]
    # No sample repeated within the epoch, and the new proportions hold in every step after the change.
    steps_before = step_unions([r["ids"] for r in before])
    steps_after = step_unions([r["ids"] for r in after]) + step_unions(rest2)
    every = np.concatenate(steps_before + steps_after)
    assert len(every) == 500 + (EPOCH - 500) // 8 * 8 and len(np.unique(every)) == len(every)
    check_streams_continue(every, {"a": 0, "b": 1}, end)
    check_within_tolerance(steps_before, {"a": 0.5, "b": 0.5}, "before the change")
    check_within_tolerance(steps_after, {"a": 0.9, "b": 0.1}, "after the change")
    from_b = int(np.sum(stream_of(np.concatenate(steps_after)) == 1))
    span = sum(len(s) for s in steps_after)
    assert abs(from_b - span * mixture_quotas([0.9, 0.1])[1] / MIX_PERIOD) <= 1


def test_add_remove_and_re_add_a_stream_continue_every_stream(streams):
    legs = [{"a": 1, "b": 1}, {"a": 1, "b": 1, "c": 1}, {"a": 1, "c": 2}, {"a": 2, "b": 1, "c": 1}]
    state, seen, every = None, [], []
    for i, weights in enumerate(legs):
        per_rank, state = run_ranks(streams, weights, world=2, steps=10 if i < 3 else None, state=state,
                                    allow=state is not None)
        steps = step_unions(per_rank)
        check_within_tolerance(steps, weights, f"leg {i}")
        seen.append({"abc"[s] for s in np.unique(stream_of(np.concatenate(steps)))})
        every.extend(steps)
    assert seen == [{"a", "b"}, {"a", "b", "c"}, {"a", "c"}, {"a", "b", "c"}]
    ids = np.concatenate(every)
    assert len(ids) == EPOCH and len(np.unique(ids)) == EPOCH  # b re-added continues where it stopped
    check_streams_continue(ids, {"a": 0, "b": 1, "c": 2}, state)
    changes = state["mixture"]["changes"]
    assert [(c["step"], c["position"], len(c["old"]), len(c["new"])) for c in changes] == \
        [(10, 80, 2, 3), (20, 160, 3, 2), (30, 240, 2, 3)]
    urls = streams[0]
    assert changes[1]["new"] == [[urls["a"], 1.0], [urls["c"], 2.0]]


def test_refused_without_the_opt_in(streams):
    _, state = run_ranks(streams, {"a": 0.5, "b": 0.5}, world=1, steps=5)
    for weights in ({"a": 0.9, "b": 0.1}, {"a": 0.5, "b": 0.5, "c": 1}, {"a": 1}):
        size = {"epoch_size": None} if len(weights) == 1 else {}  # a single stream has no epoch_size
        with pytest.raises(ValueError, match="allow_mixture_change=True"):
            make_loader(streams, weights, **size).load_state_dict(state)
        dataset = make_loader(streams, weights, **size).dataset
        with pytest.raises(ValueError, match="allow_mixture_change=True"):
            dataset.load_state_dict(state)
    # Another order field is never allowed, opt-in or not.
    with pytest.raises(ValueError, match="seed: saved 5, now 6"):
        make_loader(streams, {"a": 0.9, "b": 0.1}, seed=6).load_state_dict(state, allow_mixture_change=True)
    # A single dataset's state changes into a mixture that holds it, not into unrelated data.
    urls, cache = streams
    single = StreamingDataLoader(StreamingDataset(urls["a"], cache_dir=cache, rank=0, world_size=1, seed=5,
                                                  shuffle_window=50), batch_size=BATCH)
    first = [ids_from_tokens(b["tokens"]) for b in itertools.islice(single, 5)]
    other = StreamingDataLoader(StreamingDataset(urls["b"], cache_dir=cache, rank=0, world_size=1, seed=5,
                                                 shuffle_window=50), batch_size=BATCH)
    with pytest.raises(ValueError, match="none of the current streams"):
        other.load_state_dict(single.state_dict(), allow_mixture_change=True)
    grown, _ = run_ranks(streams, {"a": 1, "b": 1}, world=1, state=single.state_dict(), allow=True,
                         epoch_size=None)
    ids = np.concatenate(first + grown[0])
    a_ids = ids[ids < 600]
    # a's epoch goes on (its first 20 samples, then the other 580, nothing repeated), then its next epoch starts
    assert len(a_ids) > 600 and sorted(a_ids[:600]) == list(range(600))


def test_standalone_dataset_resumes_into_the_changed_mixture(streams):
    _, state = run_ranks(streams, {"a": 0.5, "b": 0.5}, world=1, steps=7)
    via_loader, _ = run_ranks(streams, {"a": 0.8, "b": 0.2}, world=1, steps=20, state=state, allow=True)
    urls, cache = streams
    dataset = StreamingDataset([Stream(urls["a"], weight=0.8), Stream(urls["b"], weight=0.2)], cache_dir=cache,
                               rank=0, world_size=1, batch_size=BATCH, **ORDER)
    dataset.load_state_dict(state, allow_mixture_change=True)
    got = [ids_from_tokens(b["tokens"]) for b in itertools.islice(iter(dataset), 20)]
    assert [g.tolist() for g in got] == [g.tolist() for g in via_loader[0]]


@pytest.mark.parametrize("interpolate", ["constant", "linear"])
def test_schedule_resumes_exactly_and_elastically(streams, interpolate):
    # 2 ranks x 4 = 8 positions per step; a linear ramp is applied per 512 steps (one 4,096-position period).
    points = {"constant": ([(0, 0.9), (300, 0.5)], [(0, 0.1), (300, 0.5)]),
              "linear": ([(0, 0.9), (2048, 0.5)], [(0, 0.1), (2048, 0.5)])}[interpolate]
    weights = {"a": Schedule(points[0], interpolate=interpolate), "b": Schedule(points[1], interpolate=interpolate)}
    options = {"epoch_size": 24_000, "shuffle_window": 50}
    reference, ref_state = run_ranks(streams, weights, world=2, **options)  # one uninterrupted epoch: 3,000 steps
    assert ref_state["mixture"]["global_batch"] == 8 and ref_state["mixture"]["changes"] == []
    head, state = run_ranks(streams, weights, world=2, steps=200, **options)
    tail, _ = run_ranks(streams, weights, world=2, state=state, **options)
    for rank in range(2):  # killed at step 200 and resumed: the identical stream
        assert [b.tolist() for b in head[rank] + tail[rank]] == [b.tolist() for b in reference[rank]]
    elastic, _ = run_ranks(streams, weights, world=3, state=state, **options)  # the schedule stays at its samples
    ref_steps = step_unions(reference)
    check_streams_continue(np.concatenate(ref_steps), {"a": 0, "b": 1}, ref_state)
    assert [b.tolist() for b in blocks(step_unions(elastic), 24)] == \
        [b.tolist() for b in blocks(ref_steps[200:], 24)][:len(blocks(step_unions(elastic), 24))]
    # The proportions follow the schedule: per step for the constant schedule, per 512-step piece for linear.
    if interpolate == "constant":
        check_within_tolerance(ref_steps[:300], {"a": 0.9, "b": 0.1}, "before step 300")
        check_within_tolerance(ref_steps[300:], {"a": 0.5, "b": 0.5}, "from step 300")
    else:
        for piece in range(4):
            middle = piece * 512 + 255.5
            share = 0.1 + 0.4 * middle / 2048
            check_within_tolerance(ref_steps[piece * 512:(piece + 1) * 512], {"a": 1 - share, "b": share},
                                   f"piece {piece}")
        check_within_tolerance(ref_steps[2048:], {"a": 0.5, "b": 0.5}, "after the ramp")


def test_schedule_and_trainer_option_validation():
    with pytest.raises(ValueError, match="steps must increase strictly"):
        Schedule([(10, 1.0), (5, 0.5)])
    with pytest.raises(ValueError, match="interpolate"):
        Schedule([(0, 1.0)], interpolate="cubic")
    assert Schedule([(0, 0.9), (100, 0.5)], interpolate="linear").at(50) == pytest.approx(0.7)
    assert Schedule([(0, 0.9), (100, 0.5)]).at(99) == 0.9
    assert data_entries("/a:[[0,0.9],[10000,0.5]] /b:linear:[[0,0.1],[10000,0.5]],/c:2") == [
        ("/a", Schedule([(0, 0.9), (10000, 0.5)])), ("/b", Schedule([(0, 0.1), (10000, 0.5)], interpolate="linear")),
        ("/c", 2.0)]
    with pytest.raises(ValueError, match="--data entry '/a:\\[\\[0,-1\\]\\]'.*weight must be"):
        data_entries("/a:[[0,-1]]")


def test_trainer_reweights_on_resume_only_with_allow_mixture_change(tmp_path, caplog):
    from shardkit.train.config import config_from_dict
    from shardkit.train.loop import build, close, train
    from train_runs import write_byte_dataset

    write_byte_dataset(str(tmp_path / "web"))  # 96 samples each: global ids 0-95 (web), 96-191 (code)
    write_byte_dataset(str(tmp_path / "code"), seed=1)
    run_dir = tmp_path / "run"

    def run_training(data: str, steps: int, **data_options) -> int:
        values = {"steps": steps, "device": "cpu", "optimizer": {"warmup_steps": 1},
                  "model": {"n_layer": 1, "d_model": 32, "n_head": 2},
                  "data": {"data": data, "batch_size": 12, "cache_dir": str(tmp_path / "cache"), **data_options},
                  "logging": {"run_dir": str(run_dir), "log_every": 100, "tensorboard": False,
                              "log_sample_ids": True}}
        run = build(config_from_dict(values))
        try:
            return train(run)
        finally:
            close(run)

    assert run_training(f"{tmp_path}/web:0.5 {tmp_path}/code:0.5", 3) == 0
    reweighted = f"{tmp_path}/web:0.9,{tmp_path}/code:0.1"
    with pytest.raises(ValueError, match="allow_mixture_change"):
        run_training(reweighted, 6)
    with caplog.at_level("INFO", logger="shardkit.loaders.order.remix"):
        assert run_training(reweighted, 6, allow_mixture_change=True) == 0
    assert "mixture changed at step 3 (epoch 0, position 36)" in caplog.text
    log = [json.loads(line) for line in (run_dir / "samples" / "rank-0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    ids = np.concatenate([r["ids"] for r in log])
    assert len(np.unique(ids)) == len(ids) == 72  # nothing repeated across the change
    from_code = [int(np.sum(np.asarray(r["ids"]) >= 96)) for r in log]
    quota = 12 * mixture_quotas([0.9, 0.1])[1] / MIX_PERIOD
    assert all(abs(n - 6) <= 1 for n in from_code[:3]) and all(abs(n - quota) <= 1 for n in from_code[3:])
