"""One job per run directory (`shardkit.train.run_lease`): the newest job takes the lease; an older one still
running (a split brain: two jobs formed from one rendezvous) stops at its next sync point with an error naming
the other job, before it writes another checkpoint (one whose check came just before the takeover may end), and
the newer job trains on from intact checkpoints."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from shardkit.train.checkpoint import checkpoint_problem, complete_checkpoints
from shardkit.train.run_lease import LEASE_NAME, RunLease
from conftest_warm import cold_environment
from train_runs import write_byte_dataset


def test_the_newest_job_holds_the_lease_and_the_older_one_learns_who_took_it(tmp_path):
    first = RunLease.take(tmp_path)
    assert first.taken_by() is None
    second = RunLease.take(tmp_path)
    taken = first.taken_by()
    assert taken == second.holder and second.taken_by() is None
    message = first.lost_message(taken)
    assert f"pid {os.getpid()}" in message and str(tmp_path) in message and "keep_alive_interval" in message
    (tmp_path / LEASE_NAME).unlink()  # a lease file removed by hand stops nobody
    assert second.taken_by() is None


def trainer(data: str, run_dir: Path, cache: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "shardkit.train", "--data", data, "--steps", "100000", "--batch-size", "4",
               "--warmup-steps", "2", "--checkpoint-every", "5", "--log-every", "5", "--keep", "3", "--device", "cpu",
               "--run-dir", str(run_dir), "--resume", "auto", "--cache-dir", str(cache)]
    # cold: the lease names the trainer's pid, which is the Popen's only when the trainer is not forked elsewhere
    return subprocess.Popen(command, env={**cold_environment(os.environ), "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def saves_after(log: str, moment: float) -> list[str]:
    """The checkpoint saves a trainer's log reports after `moment` (its lines carry the local time)."""
    return [line for line in log.splitlines() if " saved to " in line and datetime.strptime(
        line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp() > moment]


@pytest.mark.slow
def test_a_second_job_on_the_same_run_directory_stops_the_first_before_it_writes_again(tmp_path):
    data, run_dir = str(tmp_path / "data"), tmp_path / "run"
    write_byte_dataset(data, num_samples=400, samples_per_shard=50)
    older = trainer(data, run_dir, tmp_path / "cache-a")
    newer = None
    try:
        deadline = time.time() + 90
        while not complete_checkpoints(run_dir / "checkpoints") and time.time() < deadline and older.poll() is None:
            time.sleep(0.2)
        assert complete_checkpoints(run_dir / "checkpoints"), older.communicate()[1][-3000:]
        newer = trainer(data, run_dir, tmp_path / "cache-b")  # resumes from the older job's checkpoints
        _, older_log = older.communicate(timeout=120)
        taken = RunLease(path=run_dir / LEASE_NAME, holder={"id": None}).taken_by()
        assert taken is not None and taken["pid"] == newer.pid
        assert older.returncode == 2, older_log[-3000:]
        assert re.search(rf"error: another job took over run directory {re.escape(str(run_dir))} \(rank 0 on "
                         rf"\S+, pid {newer.pid}, world size 1\)", older_log), older_log[-3000:]
        assert "Traceback" not in older_log
        # At most the save of the sync point whose check came just before the takeover: none after the next one.
        assert len(saves_after(older_log, taken["taken"])) <= 1, saves_after(older_log, taken["taken"])
        newest_of_older = complete_checkpoints(run_dir / "checkpoints")[0][0]
        deadline = time.time() + 60  # the newer job trains on and saves past the older one
        while complete_checkpoints(run_dir / "checkpoints")[0][0] <= newest_of_older and time.time() < deadline:
            assert newer.poll() is None, newer.communicate()[1][-3000:]
            time.sleep(0.2)
        newer.send_signal(signal.SIGTERM)  # it saves and exits
        newer_out, newer_log = newer.communicate(timeout=60)
        assert newer.returncode == 128 + signal.SIGTERM and "checkpoint saved" in newer_out, newer_log[-3000:]
        assert "resumed from" in newer_log and "error" not in newer_log
        for _, path in complete_checkpoints(run_dir / "checkpoints"):
            assert checkpoint_problem(path) is None, path
    finally:
        for process in (older, newer):
            if process is not None and process.poll() is None:
                process.kill()
                process.communicate()
