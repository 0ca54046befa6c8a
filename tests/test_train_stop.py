"""The trainer stops when told to, whatever its sizes: loop counts have upper bounds, and SIGTERM is honoured between
micro-steps of a long gradient accumulation (a checkpoint of the last completed step, then exit)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from shardkit.train.config import (MAX_GLOBAL_BATCH_TOKENS, MAX_MICRO_STEPS, MAX_STEPS, config_from_dict,
                                   with_step_size)
from train_runs import losses, sample_ids, write_byte_dataset


@pytest.mark.parametrize(("values", "option", "bound"), [
    ({"global_batch_tokens": 2**70}, "--global-batch-tokens", MAX_GLOBAL_BATCH_TOKENS),
    ({"grad_accum": 2**40}, "--grad-accum", MAX_MICRO_STEPS),
    ({"steps": 10**12}, "--steps", MAX_STEPS),
    ({"data": {"batch_size": 2**30}}, "--batch-size", 2**20),
    ({"data": {"eval_batches": 2**30}}, "--eval-batches", 2**20),
    ({"data": {"num_workers": 10**6}}, "--num-workers", 1024),
    ({"parallelism": {"pp_microbatches": 2**30}}, "--pp-microbatches", 2**16),
])
def test_size_options_that_set_a_loop_count_have_an_upper_bound(values, option, bound):
    with pytest.raises(ValueError) as caught:
        config_from_dict(values)
    message = str(caught.value)
    assert message.startswith(f"{option} ") and f"upper bound of {bound:,}" in message and "\n" not in message
    at_bound = {k: ({name: bound for name in v} if isinstance(v, dict) else bound) for k, v in values.items()}
    config_from_dict(at_bound)  # the bound itself is allowed


def test_global_batch_tokens_may_not_imply_more_micro_steps_than_the_bound():
    config = config_from_dict({"global_batch_tokens": MAX_GLOBAL_BATCH_TOKENS, "data": {"batch_size": 1}})
    with pytest.raises(ValueError, match=r"makes 34,359,738,368 micro-steps of 32 tokens per optimizer step, over "
                                         r"the upper bound of 1,048,576"):
        with_step_size(config, seq_len=32, dp_size=1)


def test_the_cli_refuses_an_overflowed_size_in_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "shardkit.train", "--data", str(tmp_path), "--device", "cpu",
                             "--global-batch-tokens", str(2**70)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    error = [line for line in result.stderr.splitlines() if "error:" in line]  # after argparse's usage line
    assert len(error) == 1 and "--global-batch-tokens 1180591620717411303424 is over its upper bound" in error[0]
    assert "Traceback" not in result.stderr


ACCUM = 1000  # micro-steps per step: step 1 (skipped: batches drawn only) takes ~1 s, a trained one ~10 s


def _trainer(run_dir, data, *options):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "shardkit.train", "--data", data, "--device", "cpu",
                             "--batch-size", "1", "--warmup-steps", "1", "--log-sample-ids", "--log-every", "100",
                             "--run-dir", str(run_dir), "--cache-dir", str(run_dir.parent / "cache"), *options],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finished(process, timeout=120):
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise AssertionError(f"the trainer did not stop within {timeout}s:\n{out[-2000:]}\n{err[-3000:]}") from None
    return process.returncode, out, err


def _logged_steps(run_dir):
    metrics = run_dir / "metrics.jsonl"
    return {json.loads(line)["step"] for line in metrics.read_text().splitlines()} if metrics.exists() else set()


@pytest.mark.slow
def test_sigterm_during_a_long_accumulation_checkpoints_the_last_step_and_stops(tmp_path):
    data = str(tmp_path / "data")
    write_byte_dataset(data)
    run_dir = tmp_path / "run"
    # Step 1 is skipped (its batches drawn, fast), step 2 trains ACCUM micro-steps: SIGTERM comes during step 2.
    process = _trainer(run_dir, data, "--steps", "3", "--grad-accum", str(ACCUM), "--skip-steps", "1")
    started = time.monotonic()
    deadline = started + 90
    while 1 not in _logged_steps(run_dir):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    signalled = time.monotonic()
    print(f"step 1 logged after {signalled - started:.1f} s")
    process.send_signal(signal.SIGTERM)
    code, out, err = _finished(process)
    assert code == 128 + signal.SIGTERM, err[-3000:]
    print(f"stopped {time.monotonic() - signalled:.1f} s after the signal")
    # The message tells that the step was left; the time only guards against a stop that waits for the step's end.
    assert time.monotonic() - signalled < 30, "the trainer finished the step before stopping"
    assert "stopped by a signal during step 2's gradient accumulation; checkpoint of step 1 saved" in out
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000001"]
    drawn_by_step_1 = sample_ids(run_dir)[1]
    assert len(drawn_by_step_1) == ACCUM
    # The checkpoint's loader stands after step 1: resumed, step 2 (one micro-step now) gets batch ACCUM + 1 of the
    # order, as a run that draws ACCUM + 1 batches in one step shows.
    code, out, err = _finished(_trainer(run_dir, data, "--steps", "2", "--grad-accum", "1"))
    assert code == 0, err[-3000:]
    reference_dir = tmp_path / "reference"
    code, out, err = _finished(_trainer(reference_dir, data, "--steps", "1", "--grad-accum", str(ACCUM + 1),
                                        "--skip-steps", "1"))
    assert code == 0, err[-3000:]
    next_batch = Counter(sample_ids(reference_dir)[1]) - Counter(drawn_by_step_1)
    assert Counter(sample_ids(run_dir)[2]) == next_batch and sum(next_batch.values()) == 1


@pytest.mark.slow
def test_sigterm_to_a_two_rank_job_stops_every_rank_at_the_same_micro_step(tmp_path):
    """torchrun forwards SIGTERM to both ranks, which see it at different micro-steps: they agree on it at the next
    multiple of 64 (one all-reduce) and save the checkpoint of step 1 together."""
    data = str(tmp_path / "data")
    write_byte_dataset(data)
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts", "0",
         "--monitor-interval", "0.2", "-m", "shardkit.train", "--data", data, "--device", "cpu", "--batch-size", "1",
         "--warmup-steps", "1", "--log-every", "100", "--run-dir", str(run_dir), "--cache-dir",
         str(tmp_path / "cache"), "--steps", "3", "--grad-accum", str(ACCUM), "--skip-steps", "1"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while 1 not in _logged_steps(run_dir):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    code, out, err = _finished(process)
    print(f"stopped {time.monotonic() - signalled:.1f} s after the signal")
    assert code != 0
    assert "stopped by a signal during step 2's gradient accumulation; checkpoint of step 1 saved" in out, err[-3000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000001"]


@pytest.mark.parametrize("signal_at_batch", [2, 7])  # during step 1 (nothing completed yet) and during step 2
def test_a_run_stopped_between_micro_steps_resumes_exactly(tmp_path, signal_at_batch, capsys):
    """In this process (`test_train_inprocess`'s harness): SIGTERM while micro-batch k of a 4-micro-step step is
    drawn; the checkpoint holds the last completed step (none when none is: a rerun starts over) and the loader
    before the step left, so the resumed run's losses are the uninterrupted run's."""
    from test_train_inprocess import run_training

    data = str(tmp_path / "data")
    write_byte_dataset(data)
    options = {"grad_accum": 4, "data.batch_size": 3, "steps": 3}
    assert run_training(tmp_path / "reference", data, **options) == 0
    run_dir = tmp_path / "run"
    assert run_training(run_dir, data, signal_at_batch=signal_at_batch, **options) == 128 + signal.SIGTERM
    completed = (signal_at_batch - 1) // 4
    saved = f"checkpoint of step {completed} saved" if completed else "no step completed, nothing to save"
    assert f"during step {completed + 1}'s gradient accumulation; {saved}" in capsys.readouterr().out
    assert [p.name for p in (run_dir / "checkpoints").glob("step_*")] == ([f"step_{completed:08d}"] if completed else [])
    assert run_training(run_dir, data, **options) == 0
    assert losses(run_dir) == losses(tmp_path / "reference")
