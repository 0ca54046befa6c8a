"""Exact resumption of the training loop with real torchrun processes (CPU, gloo).

An uninterrupted run of 8 steps is the reference. Interrupted runs (every rank SIGKILLed; one rank
killed under `torchrun --max-restarts 1`; a rank killed in the middle of writing a checkpoint) must
resume from their last complete checkpoint and reproduce the reference's per-step losses bit for
bit (fp32), and over the whole run consume every sample id of the epoch exactly once.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from shardkit.errors import CorruptShardError
from shardkit.formats import write_dataset
from shardkit.manifest import TokenizerInfo
from shardkit.train.checkpoint import checkpoint_problem, find_latest
from shardkit.train.config import config_from_dict
from shardkit.train.loop import build, close, train
from train_runs import (NUM_SAMPLES, check_ok, checkpoints, eval_losses, losses, sample_ids, torchrun,
                        write_byte_dataset)

# All on one xdist worker (pyproject's `--dist loadgroup`): the reference runs (`reference`), a module fixture several tests share,
# is then made once, not once per worker that runs one of them.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_loop")]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("dataset")
    write_byte_dataset(str(root / "bytes"))
    write_byte_dataset(str(root / "held-out"), num_samples=48, seed=1)
    return str(root / "bytes")


def run(run_dir, data, **options):
    """torchrun with the held-out set evaluated every 4 steps."""
    return torchrun(run_dir, data, eval_data=str(Path(data).parent / "held-out"), **options)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data):
    """Uninterrupted 8-step runs, one per parallel mode, computed once and shared by the tests."""
    runs = {}

    def get(parallel: str):
        if parallel not in runs:
            run_dir = tmp_path_factory.mktemp(f"reference-{parallel}") / "run"
            check_ok(run(run_dir, data, parallel=parallel))
            runs[parallel] = run_dir
        return runs[parallel]

    return get


def assert_each_sample_once(run_dir):
    ids = sample_ids(run_dir)
    assert sorted(ids) == list(range(1, 9)), f"steps logged: {sorted(ids)}"
    consumed = [i for step_ids in ids.values() for i in step_ids]
    assert sorted(consumed) == list(range(NUM_SAMPLES)), "a sample was skipped or consumed twice"


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_sigkill_all_ranks_then_resume_is_bitwise_exact(tmp_path, data, reference, parallel):
    ref = reference(parallel)
    assert_each_sample_once(ref)
    run_dir = tmp_path / "run"
    killed = run(run_dir, data, parallel=parallel, fault="step:7")  # both ranks die before step 7
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr
    assert checkpoints(run_dir) == ["step_00000004"]
    # Steps 5 and 6 ran after the checkpoint and are lost with the kill; their sample ids are logged at once,
    # their metrics records wait for the next sync point (step 8) and die with the run.
    assert max(sample_ids(run_dir)) == 6 and max(losses(run_dir)) == 4
    resumed = check_ok(run(run_dir, data, parallel=parallel))
    assert "resumed from" in resumed.stdout and "step 4" in resumed.stdout
    assert losses(run_dir) == losses(ref)  # float equality: bitwise identical fp32 losses
    assert eval_losses(run_dir) == eval_losses(ref) and sorted(eval_losses(ref)) == [4, 8]
    assert sample_ids(run_dir) == sample_ids(ref)
    assert_each_sample_once(run_dir)


def test_torchrun_restart_after_one_rank_dies(tmp_path, data, reference):
    run_dir = tmp_path / "run"
    result = check_ok(run(run_dir, data, parallel="ddp", max_restarts=1, fault="step:7:1"))
    # Rank 1 died by SIGKILL on the first attempt...
    assert "rank 1 kills itself at step 7" in result.stderr and "exitcode: -9" in result.stderr
    assert "resumed from" in result.stdout and "step 4" in result.stdout  # ...and the restart resumed
    assert losses(run_dir) == losses(reference("ddp"))
    assert_each_sample_once(run_dir)


def test_crash_in_the_middle_of_a_save_keeps_the_previous_checkpoint(tmp_path, data, reference):
    run_dir = tmp_path / "run"
    # Checkpoints at 2, 4, 6; rank 1 dies after writing its part of step 6, before it is marked complete.
    result = check_ok(run(run_dir, data, parallel="fsdp", checkpoint_every=2, max_restarts=1,
                               fault="save:6:1"))
    assert "rank 1 kills itself at save 6" in result.stderr and "exitcode: -9" in result.stderr
    assert "step_00000004 at step 4" in result.stdout  # not the half-written step 6
    assert losses(run_dir) == losses(reference("fsdp"))
    assert_each_sample_once(run_dir)
    assert checkpoints(run_dir) == ["step_00000002", "step_00000004", "step_00000006", "step_00000008"]


@pytest.mark.parametrize("source, parallel, nproc, batch_size, extra", [
    ("fsdp", "fsdp", 1, 12, ()), ("fsdp", "fsdp", 3, 4, ()), ("ddp", "fsdp", 2, 6, ("--async-save",)),
    ("fsdp", "ddp", 2, 6, ()), ("fsdp", "hsdp", 2, 6, ("--shard-size", "1")),
], ids=["fsdp2-to-fsdp1", "fsdp2-to-fsdp3", "ddp-to-fsdp-async", "fsdp-to-ddp", "fsdp-to-hsdp"])
def test_resharded_resume_continues_the_same_run(tmp_path, data, reference, source, parallel, nproc, batch_size,
                                                 extra):
    """A checkpoint resumes at another world size or parallel mode. The global batch stays 12
    samples, so the resumed steps see the same samples and give the same losses up to float
    rounding (the reduction order changes with the world size)."""
    ref = reference(source)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(ref / "checkpoints" / "step_00000004", run_dir / "checkpoints" / "step_00000004")
    result = check_ok(run(run_dir, data, parallel=parallel, nproc=nproc, batch_size=batch_size, extra=extra))
    if nproc != 2:  # another world size: the log says the checkpoint was resharded
        assert "saved by 2 ranks, now %d: resharded" % nproc in result.stderr
    resumed, expected = losses(run_dir), losses(ref)
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in resumed:
        assert resumed[step] == pytest.approx(expected[step], rel=1e-4), step
    assert sample_ids(run_dir) == {step: ids for step, ids in sample_ids(ref).items() if step > 4}
    assert checkpoints(run_dir) == ["step_00000004", "step_00000008"]  # the final save completed (async too)


def test_fsdp_bf16_accumulation_and_activation_checkpointing(tmp_path, data, reference):
    """FSDP2 with bf16 parameters / fp32 reduction, gradient accumulation (no reduce-scatter on the
    first micro-step) and activation checkpointing trains the same samples to nearly the same losses."""
    run_dir = tmp_path / "run"
    check_ok(run(run_dir, data, parallel="fsdp", batch_size=3, checkpoint_every=0,
                 extra=("--precision", "bf16", "--grad-accum", "2", "--activation-checkpointing")))
    resumed, expected = losses(run_dir), losses(reference("fsdp"))
    assert sorted(resumed) == sorted(expected)
    for step in expected:
        assert resumed[step] == pytest.approx(expected[step], rel=2e-2), step
    assert sample_ids(run_dir) == sample_ids(reference("fsdp"))


def test_an_eval_set_from_another_tokenizer_fails_before_step_1(tmp_path, data, capsys):
    """Ids of a 50257-word vocabulary in the eval set of a byte-level model: refused at start-up, naming
    both datasets and what differs (it used to fail with IndexError after the last step, unsaved)."""
    from shardkit.cli import main

    rng = np.random.default_rng(0)
    held_out = tmp_path / "gpt2-held-out"
    write_dataset(str(held_out), (rng.integers(0, 50257, 33).astype(np.uint16) for _ in range(24)),
                  tokenizer=TokenizerInfo(kind="tiktoken", name="gpt2", vocab_size=50257), seq_len=32,
                  packing="concat")
    code = main(["train", "--data", data, "--eval-data", str(held_out), "--steps", "2", "--warmup-steps", "1",
                 "--device", "cpu", "--run-dir", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache"),
                 "--tensorboard", "false"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert f"--eval-data {held_out} does not match --data {data}" in err
    assert "tokenizer tiktoken:gpt2 vs byte:byte" in err and "vocab_size 50257 vs 256" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # not one step trained


@pytest.mark.parametrize("eval_every, failing_step", [(0, 4), (2, 2)], ids=["final-eval", "periodic-eval"])
def test_a_failing_evaluation_saves_the_training_state_first(tmp_path, data, eval_every, failing_step):
    """The eval set passes the start-up check, then its shard is damaged on disk: the evaluation that
    reads it fails, and a complete checkpoint of the step it failed at is left (no --checkpoint-every)."""
    held_out = tmp_path / "held-out"
    shutil.copytree(Path(data).parent / "held-out", held_out)
    values = {"steps": 4, "device": "cpu", "eval_every": eval_every, "optimizer": {"warmup_steps": 1},
              "data": {"data": data, "eval_data": str(held_out), "batch_size": 4, "eval_batches": 1,
                       "cache_dir": str(tmp_path / "cache")},
              "logging": {"run_dir": str(tmp_path / "run"), "tensorboard": False}}
    run = build(config_from_dict(values))
    try:
        for shard in held_out.glob("shard-*"):
            shard.write_bytes(b"\0" * shard.stat().st_size)
        with pytest.raises(CorruptShardError):
            train(run)
    finally:
        close(run)
    checkpoint = find_latest(tmp_path / "run" / "checkpoints")
    assert checkpoint is not None and checkpoint.name == f"step_{failing_step:08d}"
    assert checkpoint_problem(checkpoint) is None
    assert sorted(losses(tmp_path / "run")) == list(range(1, failing_step + 1))


def learning_rates(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"] for r in records if "lr" in r}


def test_extending_steps_on_resume_rescales_the_schedule_and_says_so(tmp_path, data, capsys):
    """Trained for --steps 4, resumed with --steps 8: from step 5 on, the learning rates are those of a
    run planned for 8 steps from the start (before the fix, step 5 still ran at the old schedule's rate)."""
    def train_for(run_dir, steps):
        values = {"steps": steps, "device": "cpu", "optimizer": {"warmup_steps": 1},
                  "data": {"data": data, "batch_size": 4, "cache_dir": str(tmp_path / "cache")},
                  "logging": {"run_dir": str(run_dir), "tensorboard": False}}
        run = build(config_from_dict(values))
        try:
            assert train(run) == 0
        finally:
            close(run)

    train_for(tmp_path / "planned", 8)
    train_for(tmp_path / "extended", 4)
    capsys.readouterr()
    train_for(tmp_path / "extended", 8)
    out = capsys.readouterr().out
    assert "--steps changed from 4 (checkpoint) to 8: the learning-rate schedule is rescaled to 8 steps" in out
    planned, extended = learning_rates(tmp_path / "planned"), learning_rates(tmp_path / "extended")
    assert {step: extended[step] for step in range(5, 9)} == {step: planned[step] for step in range(5, 9)}
    assert extended[4] != planned[4]  # the first 4 steps followed the 4-step schedule


KILLS_PER_MODE = 2


@pytest.mark.parametrize("parallel, seed", [("ddp", 1), ("fsdp", 2)])
def test_sigkill_at_random_moments_from_outside_then_exact_resume(tmp_path, data, reference, parallel, seed,
                                                                 figures):
    """The self-inflicted kills above happen only at step boundaries. Here a watcher process, outside the
    run's process tree, SIGKILLs the launcher and every rank at a seeded random moment after a seeded
    checkpoint (mid-step, in a collective, during a save, in an evaluation). The resumed run must say it
    continued from the newest complete checkpoint the kill left and repeat the reference exactly."""
    import random
    import subprocess
    import sys

    from train_kill_harness import resumed_from

    rng = random.Random(seed)
    ref = reference(parallel)
    counts = {"runs": 0, "kills": 0, "resumed_from_checkpoint": 0, "steps_redone": 0, "loss_mismatches": 0,
              "id_mismatches": 0}
    for point in range(KILLS_PER_MODE):
        run_dir = tmp_path / f"run-{point}"
        # A step takes ~25 ms here, a save a few times that: the moment falls in the next few steps or saves.
        target, delay = rng.choice((2, 4)), rng.uniform(0.0, 0.2)
        watcher = subprocess.Popen([sys.executable, str(Path(__file__).with_name("train_kill_harness.py")),
                                    "kill-torchrun", str(run_dir), str(target), str(delay)],
                                   stdout=subprocess.PIPE, text=True)
        killed = run(run_dir, data, parallel=parallel, checkpoint_every=2)
        kill = json.loads(watcher.communicate(timeout=150)[0].strip().splitlines()[-1])
        assert kill["killed"] >= 3 and killed.returncode != 0, (kill, killed.returncode, killed.stderr[-2000:])
        counts["runs"] += 1
        counts["kills"] += 1
        latest = find_latest(run_dir / "checkpoints")
        counts["steps_redone"] += max(sample_ids(run_dir), default=0) - int(latest.name[5:]) if latest else 0
        resumed = check_ok(run(run_dir, data, parallel=parallel, checkpoint_every=2))
        assert latest is not None and latest.name != "step_00000008", (latest, kill)  # killed mid-run
        assert f"resumed from {latest} at step {int(latest.name[5:])}" in resumed.stdout, resumed.stdout
        assert resumed_from(run_dir) == [latest.name]
        counts["resumed_from_checkpoint"] += 1
        counts["loss_mismatches"] += losses(run_dir) != losses(ref)
        counts["id_mismatches"] += sample_ids(run_dir) != sample_ids(ref)
        assert losses(run_dir) == losses(ref) and eval_losses(run_dir) == eval_losses(ref)
        assert sample_ids(run_dir) == sample_ids(ref)
        assert_each_sample_once(run_dir)
    assert counts["resumed_from_checkpoint"] == KILLS_PER_MODE, counts
    figures.add(f"sigkill_training_{parallel}_outside", **counts)
