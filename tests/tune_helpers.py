"""Helpers for the `shardkit tune` tests: a tiny dataset pair and the tuner's command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from train_runs import write_byte_dataset



def tune_env() -> dict[str, str]:
    """The environment of a tuner the tests start, read when it starts (not when this module is imported): it then
    names the suite's warm-start server (conftest_warm), which the session sets up after the test modules are
    imported, so the one-rank trials are forked warm."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def make_datasets(root: Path) -> tuple[str, str]:
    """(training, evaluation) dataset URLs: byte-level samples of this repository's sources."""
    write_byte_dataset(str(root / "train"), num_samples=64, seq_len=32, seed=0)
    write_byte_dataset(str(root / "eval"), num_samples=16, seq_len=32, seed=1)
    return str(root / "train"), str(root / "eval")


def trainer_args(datasets: tuple[str, str], cache: Path, *, steps: int, eval_every: int) -> list[str]:
    train, evaluation = datasets
    return ["--data", train, "--eval-data", evaluation, "--steps", str(steps), "--eval-every", str(eval_every),
            "--eval-batches", "1", "--batch-size", "4", "--warmup-steps", "1", "--device", "cpu",
            "--tensorboard", "false", "--log-every", "1000", "--cache-dir", str(cache)]


def tune_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "shardkit", "tune", *args]


def run_tune(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    result = subprocess.run(tune_command(*args), env=tune_env(), capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"shardkit tune failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-5000:]}")
    return result


def metrics(run_dir: str | Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]


def final_eval(run_dir: str | Path, step: int) -> float:
    return [r["eval_loss"] for r in metrics(run_dir) if "eval_loss" in r and r["step"] == step][-1]


def load_study(output: Path, name: str = "shardkit"):
    import optuna

    return optuna.load_study(study_name=name, storage=f"sqlite:///{output / 'study.db'}")


def study_rows(output):
    """(number, state, datetime_complete) of every trial, read straight from the SQLite database: a poll that takes
    milliseconds, where loading the study through Optuna takes a second or more on a loaded machine (long enough to
    miss a trial's whole run)."""
    import sqlite3

    with sqlite3.connect(output / "study.db", timeout=30) as db:
        try:
            return db.execute("SELECT number, state, datetime_complete FROM trials ORDER BY number").fetchall()
        except sqlite3.OperationalError as error:
            # The tuner creates the database file before Optuna has created its tables.
            if "no such table" in str(error):
                return []
            raise


def kill_tuner_during_second_trial(args: list[str], output: Path, states, *, timeout: float = 180,
                                   metrics_of=None) -> None:
    """Start `shardkit tune ARGS` in a session of its own, wait until one trial finished and the next one
    trains (`states()`: the study's trial states in order, [] before the study exists; `metrics_of(number)`:
    the metrics.jsonl trial `number` writes, default its trial directory's), then SIGKILL the whole tree
    (tuner and trainers), as a lost machine would."""
    import signal
    import time

    log_path = output.parent / f"{output.name}-killed-tuner.log"  # beside the output: what failed says why
    with open(log_path, "wb") as log:
        tuner = subprocess.Popen(tune_command(*args), env=tune_env(), start_new_session=True,
                                 stdout=log, stderr=subprocess.STDOUT)
    current: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and tuner.poll() is None:
            current = states()
            running = (metrics_of(len(current) - 1) if metrics_of else
                       output / "trials" / f"trial_{len(current) - 1:05d}" / "metrics.jsonl")
            if current.count("COMPLETE") == 1 and current[-1] == "RUNNING" and running.exists():
                return  # one trial finished, the next one is training
            if current.count("COMPLETE") > 1 or "FAIL" in current:
                break  # past the moment to kill, or a trial failed: say so now, not at the deadline
            time.sleep(0.1)
        raise AssertionError(f"the tuner did not reach its second trial while it trained (trial states {current}, "
                             f"tuner exit status {tuner.poll()}); its log ends:\n"
                             f"{log_path.read_text(errors='replace')[-3000:]}")
    finally:
        os.killpg(tuner.pid, signal.SIGKILL)
        tuner.wait()
