"""Trainer `--skip-steps`: the real training loop in this process (tiny model, 8 steps of 12 samples)."""

from __future__ import annotations

import json

import pytest

from shardkit.train.checkpoint import find_latest, read_marker
from shardkit.train.config import TrainingConfig
from shardkit.train.step_ranges import format_steps, parse_steps
from test_train_inprocess import run_training
from train_runs import losses, sample_ids, write_byte_dataset

SKIP = "3-4,7"


def records(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r or "skipped" in r}


def skipped_in_log(run_dir) -> set[int]:
    lines = [json.loads(line) for line in (run_dir / "samples" / "rank-0.jsonl").read_text().splitlines()]
    return {r["step"] for r in lines if r.get("skipped")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(dataset, reference run, run with --skip-steps 3-4,7)."""
    root = tmp_path_factory.mktemp("skip_steps")
    write_byte_dataset(str(root / "train"))
    reference, skipping = root / "reference" / "run", root / "skipping" / "run"
    assert run_training(reference, str(root / "train"), **{"logging.log_sample_ids": True}) == 0
    assert run_training(skipping, str(root / "train"), skip_steps=SKIP, **{"logging.log_sample_ids": True}) == 0
    return str(root / "train"), reference, skipping


def test_skipped_steps_drop_their_batches_and_every_other_step_keeps_its_own(runs):
    _, reference, skipping = runs
    # Every step, skipped or not, drew exactly the samples it draws without --skip-steps.
    assert sample_ids(skipping) == sample_ids(reference) and len(sample_ids(reference)) == 8
    assert skipped_in_log(skipping) == {3, 4, 7}
    trained = losses(skipping)
    assert sorted(trained) == [1, 2, 5, 6, 8]
    assert all(trained[s] == losses(reference)[s] for s in (1, 2))  # before the first skip: the same run
    assert trained[5] != losses(reference)[5]  # steps 3 and 4 took no update
    # The schedule moves on through skipped steps: step 5 runs at the reference's step-5 learning rate.
    assert records(skipping)[5]["lr"] == records(reference)[5]["lr"]
    assert {s for s, r in records(skipping).items() if r.get("skipped")} == {3, 4, 7}
    assert json.loads((skipping / "config.json").read_text())["training"]["skip_steps"] == SKIP
    assert read_marker(find_latest(skipping / "checkpoints"))["skip_steps"] == SKIP


def test_a_resumed_run_goes_on_skipping_what_the_checkpoint_recorded(runs, tmp_path):
    data, _, skipping = runs
    run_dir = tmp_path / "run"
    # SIGTERM while step 5 waits for its batch: the checkpoint after step 5 records the skipped steps.
    assert run_training(run_dir, data, signal_at_batch=5, skip_steps=SKIP, **{"logging.log_sample_ids": True}) != 0
    assert run_training(run_dir, data, **{"logging.log_sample_ids": True}) == 0  # no --skip-steps this time
    assert losses(run_dir) == losses(skipping)
    assert sample_ids(run_dir) == sample_ids(skipping) and skipped_in_log(run_dir) == {3, 4, 7}
    assert json.loads((run_dir / "config.json").read_text())["training"]["skip_steps"] == SKIP


def test_skip_steps_are_parsed_and_bad_ones_named():
    assert format_steps(parse_steps("1200-1260, 3100 5")) == "5,1200-1260,3100"
    assert TrainingConfig(skip_steps="9,8,7").skip_steps == "7-9"
    for bad in ("0", "5-3", "x", "3-"):
        with pytest.raises(ValueError, match=f"--skip-steps entry '{bad}'"):
            TrainingConfig(skip_steps=bad)


def test_the_trainer_leaves_skip_samples_out_of_training_only(tmp_path):
    data, held_out = str(tmp_path / "train"), str(tmp_path / "held_out")
    write_byte_dataset(data)
    write_byte_dataset(held_out, num_samples=48, seed=1)
    skip = set(range(60, 72))  # ids past the held-out set's 48: they name training samples only
    run_dir = tmp_path / "run"
    assert run_training(run_dir, data, steps=4, eval_every=2, **{
        "data.skip_samples": "60-71", "data.eval_data": held_out, "data.eval_batches": 1,
        "logging.log_sample_ids": True}) == 0
    trained = [i for ids in sample_ids(run_dir).values() for i in ids]
    assert len(trained) == len(set(trained)) == 48 and not skip & set(trained)
    # The run's config keeps the range as an interval (issue 25 item 6), not 12 ids.
    assert json.loads((run_dir / "config.json").read_text())["data"]["loader"]["skip_samples"] == [[60, 71]]


def test_ranges_stay_intervals_in_the_config_and_the_loop(runs, tmp_path):
    import tracemalloc

    tracemalloc.start()
    config = TrainingConfig(skip_steps="1-3000000, 2999999-5000000, 9")  # a set of these would take ~300 MB
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1_000_000 and config.skip_steps == "1-5000000"
    steps = parse_steps("4-99999999999999") | parse_steps("2")
    assert 2 in steps and 3 not in steps and 99999999999999 in steps and 10**14 not in steps
    assert str(steps) == "2,4-99999999999999" and len(steps) == 99999999999997
    data, _, _ = runs
    run_dir = tmp_path / "run"
    assert run_training(run_dir, data, steps=4, skip_steps="3-99999999999999") == 0
    assert {s for s, r in records(run_dir).items() if r.get("skipped")} == {3, 4}
    assert read_marker(find_latest(run_dir / "checkpoints"))["skip_steps"] == "3-99999999999999"
