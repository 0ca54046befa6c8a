"""`shardkit tune` with Optuna over real trainer subprocesses: a TPE study, pruning, a killed tuner
rerun, and the best configuration reproduced bitwise."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time

import pytest

from tune_helpers import ENV, final_eval, load_study, make_datasets, metrics, run_tune, trainer_args, tune_command

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    return make_datasets(tmp_path_factory.mktemp("tune-data"))


def test_tpe_study_stores_each_runs_final_eval_loss_and_best_toml_reproduces_it(datasets, tmp_path):
    output = tmp_path / "tune"
    result = run_tune(*trainer_args(datasets, tmp_path / "cache", steps=4, eval_every=2),
                      "--space", "lr=loguniform:1e-4:1e-2", "--trials", "6", "--sampler", "tpe",
                      "--pruner", "none", "--parallel-trials", "2", "--output", str(output))
    study = load_study(output)
    trials = study.trials
    assert [t.state.name for t in trials] == ["COMPLETE"] * 6
    run_dirs = [t.user_attrs["run_dir"] for t in trials]
    assert len(set(run_dirs)) == 6
    for trial in trials:
        assert 1e-4 <= trial.params["lr"] <= 1e-2
        assert trial.value == final_eval(trial.user_attrs["run_dir"], 4)  # the run's own record, exactly
        assert sorted(trial.intermediate_values) == [2, 4]  # reported as the evaluations happened
    with open(output / "trials.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["trial"]) for r in rows] == [t.number for t in trials]
    assert all((output / name).stat().st_size > 0 for name in ("history.png", "importances.png"))
    best = study.best_trial
    assert f"{best.value:.6g}" in result.stdout  # the table on stdout

    # The best configuration, run again by the trainer alone, gives the same loss bit for bit.
    again = tmp_path / "again"
    subprocess.run([sys.executable, "-m", "shardkit.train", "--config", str(output / "best.toml"),
                    "--run-dir", str(again)], env=ENV, check=True, capture_output=True, timeout=120)
    assert final_eval(again, 4) == best.value


def test_pruning_stops_a_trial_with_an_absurd_learning_rate(datasets, tmp_path):
    output = tmp_path / "tune"
    # Random sampler, seed 6: trials 0 and 1 draw lr 0.002, trial 2 draws 50 (pruned against the first two).
    run_tune(*trainer_args(datasets, tmp_path / "cache", steps=60, eval_every=2),
             "--space", "lr=choice:0.002,50.0", "--trials", "3", "--sampler", "random", "--sampler-seed", "6",
             "--pruner", "median", "--prune-startup-trials", "1", "--output", str(output))
    trials = load_study(output).trials
    assert [(t.params["lr"], t.state.name) for t in trials] == [
        (0.002, "COMPLETE"), (0.002, "COMPLETE"), (50.0, "PRUNED")]
    pruned = trials[2]
    assert pruned.user_attrs["pruned_at_step"] < 60
    # Terminated, not run to the end: its metrics stop long before step 60.
    assert max(r["step"] for r in metrics(pruned.user_attrs["run_dir"])) < 60


def _study_rows(output):
    """(number, state, params, datetime_complete) of every trial, read straight from the database."""
    import sqlite3

    with sqlite3.connect(output / "study.db", timeout=30) as db:
        try:
            return db.execute("SELECT number, state, datetime_complete FROM trials ORDER BY number").fetchall()
        except sqlite3.OperationalError as error:
            # The tuner creates the database file before Optuna has created its tables.
            if "no such table" in str(error):
                return []
            raise


def test_sigkill_of_the_tuner_tree_mid_trial_then_rerun_ends_at_n_trials(datasets, tmp_path):
    output = tmp_path / "tune"
    args = [*trainer_args(datasets, tmp_path / "cache", steps=30, eval_every=10),
            "--space", "lr=loguniform:1e-3:1e-2", "--trials", "3", "--sampler", "random",
            "--pruner", "none", "--output", str(output)]
    # Its own session: killpg reaches the tuner and every trainer it started (the whole tree).
    tuner = subprocess.Popen(tune_command(*args), env=ENV, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            rows = _study_rows(output) if (output / "study.db").exists() else []
            states = [row[1] for row in rows]
            running = (output / "trials" / f"trial_{len(rows) - 1:05d}" / "metrics.jsonl")
            if states.count("COMPLETE") == 1 and states[-1] == "RUNNING" and running.exists():
                break  # one trial finished, the next one is training
            time.sleep(0.1)
        else:
            pytest.fail("the tuner did not reach its second trial in time")
    finally:
        os.killpg(tuner.pid, signal.SIGKILL)
        tuner.wait()
    before = _study_rows(output)
    finished_before = {row[0]: row for row in before if row[1] == "COMPLETE"}
    finished_files = {n: (output / "trials" / f"trial_{n:05d}" / "metrics.jsonl").read_bytes()
                      for n in finished_before}
    interrupted = before[-1][0]
    assert before[-1][1] == "RUNNING"

    run_tune(*args)
    study = load_study(output)
    trials = study.trials
    finished = [t for t in trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(finished) == 3
    numbers = [t.number for t in trials]
    assert len(numbers) == len(set(numbers))
    run_dirs = [t.user_attrs["run_dir"] for t in trials]
    assert len(run_dirs) == len(set(run_dirs))  # no trial ran twice in one directory
    for number, row in finished_before.items():  # finished trials were not rerun
        assert tuple(_study_rows(output)[number]) == row
        assert (output / "trials" / f"trial_{number:05d}" / "metrics.jsonl").read_bytes() == finished_files[number]
    failed = trials[interrupted]
    assert failed.state.name == "FAIL" and failed.user_attrs["interrupted"]
    retries = [t for t in trials if t.user_attrs.get("retry_of") == interrupted]
    assert len(retries) == 1 and retries[0].params == failed.params and retries[0].state.name == "COMPLETE"


@pytest.mark.parametrize("extra, expected", [
    (["--space", "lr=loguniform:1e-4"], "--space 'lr=loguniform:1e-4': loguniform takes LOW:HIGH"),
    (["--space", "lr=normal:0:1"], "expected NAME=KIND:ARGS"),
    (["--space", "learning_rate=loguniform:1e-4:1e-2"], "unknown trainer option 'learning_rate'"),
    (["--space", "optimizer.n_layer=int:1:4"], "unknown trainer option 'optimizer.n_layer'"),
    (["--space", "lr=uniform:-1:1"], "--lr must be positive"),
    (["--space", "lr=loguniform:1e-4:1e-2", "--storage", "postgresql://127.0.0.1:1/x"],
     "cannot open --storage postgresql://127.0.0.1:1/x"),
    (["--space", "lr=loguniform:1e-4:1e-2", "--storage", "sqlite:////nonexistent/dir/study.db"],
     "cannot open --storage sqlite:////nonexistent/dir/study.db"),
    (["--space", "lr=loguniform:1e-4:1e-2", "--eval-every", "0"], "--pruner median needs --eval-every"),
])
def test_bad_input_is_one_clear_line_and_exit_2(datasets, tmp_path, capsys, extra, expected):
    from shardkit.cli.main import main

    code = main(["tune", *trainer_args(datasets, tmp_path / "cache", steps=4, eval_every=2),
                 "--output", str(tmp_path / "tune"), *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("shardkit tune: error:") and expected in err
    assert "\n" not in err and "Traceback" not in err
    assert not (tmp_path / "tune" / "trials").exists()  # no trial started
