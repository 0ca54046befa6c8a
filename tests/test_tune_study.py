"""`shardkit tune` with Optuna over real trainer subprocesses: a TPE study, pruning, a killed tuner
rerun, and the best configuration reproduced bitwise."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_build import write_corpus
from train_runs import write_byte_dataset
from tune_helpers import (final_eval, kill_tuner_during_second_trial, load_study, make_datasets, metrics,
                          run_tune, study_rows, trainer_args, tune_command, tune_env)

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
                    "--run-dir", str(again)], env=tune_env(), check=True, capture_output=True, timeout=120)
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


def test_a_study_trains_from_raw_text_and_searches_the_packing(tmp_path):
    # The trainer's raw-text options reach every trial: without --tokenizer a trial would read the glob as a
    # built dataset and fail. The packing, fixed by a build otherwise, is searched like any option.
    corpus = write_corpus(tmp_path / "corpus", docs=40)
    output = tmp_path / "tune"
    run_tune("--data", f"{corpus}/*.jsonl*", "--eval-data", f"{corpus}/d.parquet", "--tokenizer", "byte",
             "--seq-len", "32", "--lanes", "2", "--steps", "2", "--eval-every", "2", "--eval-batches", "1",
             "--batch-size", "2", "--warmup-steps", "1", "--device", "cpu", "--tensorboard", "false",
             "--log-every", "1000", "--space", "pack=choice:concat,bestfit", "--trials", "2", "--sampler", "grid",
             "--pruner", "none", "--output", str(output))
    trials = load_study(output).trials
    assert [t.state.name for t in trials] == ["COMPLETE"] * 2
    assert sorted(t.params["pack"] for t in trials) == ["bestfit", "concat"]
    for trial in trials:
        assert trial.user_attrs["trainer_config"]["data"]["tokenizer"] == "byte"
        assert trial.value == final_eval(trial.user_attrs["run_dir"], 2)


def test_sigkill_of_the_tuner_tree_mid_trial_then_rerun_ends_at_n_trials(datasets, tmp_path):
    output = tmp_path / "tune"
    args = [*trainer_args(datasets, tmp_path / "cache", steps=30, eval_every=10),
            "--space", "lr=loguniform:1e-3:1e-2", "--trials", "3", "--sampler", "random",
            "--pruner", "none", "--output", str(output)]
    kill_tuner_during_second_trial(args, output, lambda: [row[1] for row in study_rows(output)]
                                   if (output / "study.db").exists() else [], timeout=120)
    before = study_rows(output)
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
        assert tuple(study_rows(output)[number]) == row
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
    (["--sampler", "pbt", "--perturb-every", "2", "--population", "2", "--space", "n_layer=int:1:3"],
     "--sampler pbt copies checkpoints between members, so it cannot search model options (--n-layer)"),
    (["--space", "compile=choice:true,maybe"], "choice 'maybe' is not a valid bool"),
    (["--tokenizer", "byte", "--space", "lr=loguniform:1e-4:1e-2"],
     "--tokenizer (training from raw text) needs --seq-len"),
    (["--space", "lr=loguniform:1e-4:1e-2", "--checkpoint-root", "shared/pbt"],
     "--checkpoint-root is where PBT members' checkpoints go: give it with --sampler pbt"),
    (["--sampler", "pbt", "--perturb-every", "2", "--population", "2", "--space", "lr=loguniform:1e-4:1e-2",
      "--checkpoint-root", "nosuch://bucket/pbt"], "--checkpoint-root nosuch://bucket/pbt: Protocol not known"),
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


@pytest.mark.parametrize("url", ["postgresql://user:pa@ss-SENTINEL@127.0.0.1:1/x",
                                 "postgresql://127.0.0.1:1/x?sslmode=disable&password=SENTINEL",
                                 "postgresql:user:SENTINEL@127.0.0.1",
                                 "postgresql://user:SENTINEL@127.0.0.1:1:2:3/x"])
def test_a_storage_url_is_printed_without_its_password_whatever_its_shape(datasets, tmp_path, capsys, url):
    from shardkit.cli.main import main

    code = main(["tune", *trainer_args(datasets, tmp_path / "cache", steps=4, eval_every=2),
                 "--output", str(tmp_path / "tune"), "--space", "lr=loguniform:1e-4:1e-2", "--storage", url])
    captured = capsys.readouterr()
    assert code == 2 and "cannot open --storage postgresql" in captured.err
    assert "SENTINEL" not in captured.out + captured.err and "Traceback" not in captured.err


@pytest.mark.s3
def test_storage_options_reach_trials_but_never_their_command_line(tmp_path, s3_bucket):
    import subprocess

    url, options = s3_bucket
    options = {**options, "key": "AKIAEXAMPLE", "secret": "sentinel-secret-4e1f9c"}  # moto takes any credentials
    write_byte_dataset(f"{url}/train", num_samples=64, seq_len=32, storage_options=options)
    write_byte_dataset(f"{url}/eval", num_samples=16, seq_len=32, seed=1, storage_options=options)
    secret = options["secret"]
    output = tmp_path / "tune"
    process = subprocess.Popen(tune_command(*trainer_args((f"{url}/train", f"{url}/eval"), tmp_path / "cache", steps=2,
                                                          eval_every=2),
                                            "--storage-options", json.dumps(options), "--output", str(output),
                                            "--trials", "1", "--space", "lr=loguniform:1e-4:1e-2"),
                               env=tune_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    trainers = {}
    while process.poll() is None:  # every trainer process's command line, as any local user can read it
        for entry in Path("/proc").iterdir():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"shardkit.train" in argv and str(output).encode() in b" ".join(argv):  # ours, not other tests
                trainers[entry.name] = b" ".join(argv).decode()
        time.sleep(0.05)
    out = process.stdout.read()
    assert process.returncode == 0, out[-3000:]
    assert trainers and not [argv for argv in trainers.values() if secret in argv]
    assert load_study(output).trials[0].state.name == "COMPLETE"  # the trial read the bucket with them
    assert secret not in (output / "trials" / "trial_00000" / "trial.toml").read_text()


def test_a_full_disk_is_one_line_and_leaves_no_half_written_report(datasets, tmp_path, small_disk):
    import optuna

    disk = small_disk("4m")
    output = disk / "tune"
    output.mkdir()
    optuna.create_study(study_name="shardkit", storage=f"sqlite:///{output / 'study.db'}")
    filler = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:  # take every block that is left
        while True:
            os.write(filler, b"\0" * 65536)
    except OSError:
        pass
    finally:
        os.close(filler)
    command = tune_command(*trainer_args(datasets, tmp_path / "cache", steps=2, eval_every=2), "--output", str(output),
                           "--trials", "1", "--space", "lr=loguniform:1e-4:1e-2")
    result = subprocess.run(command, env=tune_env(), capture_output=True, text=True, timeout=150)
    errors = [line for line in result.stderr.splitlines() if line.startswith("shardkit tune: error:")]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert any(f"no space left for the study database sqlite:///{output / 'study.db'} in {output}" in line
               for line in errors), errors
    assert sorted(p.name for p in output.iterdir() if p.name not in ("trials", "study.db.lock")) == ["study.db"]  # no half-written file
    from shardkit.tune import tomlfile

    with pytest.raises(OSError, match=f"no space left in {output} to write trials.csv: it needs 100,000 bytes"):
        tomlfile.write_text(output / "trials.csv", "x" * 100_000)  # how every report is written
    assert sorted(p.name for p in output.iterdir() if p.name not in ("trials", "study.db.lock")) == ["study.db"]
    (disk / "filler").unlink()
    run_tune(*command[4:])  # with space again the same command finishes the study
    rows = list(csv.DictReader(open(output / "trials.csv")))
    assert [row["state"] for row in rows] == ["COMPLETE"]


def test_a_grid_search_that_completes_its_grid_exits_0(datasets, tmp_path):
    output = tmp_path / "grid"
    run_tune(*trainer_args(datasets, tmp_path / "cache", steps=2, eval_every=2), "--output", str(output),
             "--sampler", "grid", "--grid-points", "2", "--trials", "5", "--pruner", "none",
             "--space", "lr=loguniform:1e-4:1e-2")
    trials = load_study(output).trials
    assert sorted(t.params["lr"] for t in trials) == pytest.approx([1e-4, 1e-2])  # each grid point once
    assert all(t.state.name == "COMPLETE" for t in trials)


def test_parallel_trials_get_a_metrics_port_each(datasets, tmp_path):
    from conftest import free_port

    output, port = tmp_path / "ports", free_port(2)  # trial k serves on P + k
    run_tune(*trainer_args(datasets, tmp_path / "cache", steps=2, eval_every=2), "--output", str(output),
             "--trials", "2", "--parallel-trials", "2", "--pruner", "none", "--metrics-port", str(port),
             "--space", "lr=loguniform:1e-4:1e-2")
    study = load_study(output)
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"], "\n".join(
        (Path(t.user_attrs["run_dir"]) / "trial.log").read_text()[-2000:] for t in study.trials
        if t.state.name != "COMPLETE")  # why a trial failed, in CI's log
    import tomllib

    ports = sorted(tomllib.loads((Path(t.user_attrs["run_dir"]) / "trial.toml").read_text())["logging"]["metrics_port"]
                   for t in study.trials)
    assert ports == [port, port + 1]


def test_metrics_ports_of_parallel_trials_must_fit(datasets, tmp_path, capsys):
    from shardkit.cli.main import main

    code = main(["tune", *trainer_args(datasets, tmp_path / "cache", steps=4, eval_every=2), "--output",
                 str(tmp_path / "tune"), "--space", "lr=loguniform:1e-4:1e-2", "--parallel-trials", "3",
                 "--nproc-per-trial", "2", "--metrics-port", "65531"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--metrics-port 65531 leaves no room for 3 trial(s) at once of 2 rank(s)" in err
    assert "\n" not in err


def test_tune_runs_on_its_defaults_without_eval_every(datasets, tmp_path):
    args = trainer_args(datasets, tmp_path / "cache", steps=20, eval_every=0)
    at = args.index("--eval-every")
    del args[at:at + 2]  # not given at all: the default median pruner still needs evaluations
    result = run_tune(*args, "--output", str(tmp_path / "tune"), "--trials", "1", "--space", "lr=loguniform:1e-4:1e-2")
    assert "no --eval-every given: trials evaluate every 2 steps (--steps 20 / 10) for --pruner median" in result.stderr
    [trial] = load_study(tmp_path / "tune").trials
    assert trial.state.name == "COMPLETE" and sorted(trial.intermediate_values) == list(range(2, 21, 2))


def test_tuners_started_together_on_one_sqlite_study_run_exactly_the_trials_asked(datasets, tmp_path):
    import tomllib

    output = tmp_path / "shared"
    command = tune_command(*trainer_args(datasets, tmp_path / "cache", steps=2, eval_every=2), "--output", str(output),
                           "--trials", "3", "--parallel-trials", "2", "--pruner", "none",
                           "--space", "lr=loguniform:1e-4:1e-2")
    tuners = [subprocess.Popen(command, env=tune_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]  # a fresh study: both create its tables at once
    outputs = [tuner.communicate(timeout=300)[0] for tuner in tuners]
    assert [tuner.returncode for tuner in tuners] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    trials = load_study(output).trials
    ran = [t for t in trials if not t.user_attrs.get("surplus")]
    assert [t.state.name for t in ran] == ["COMPLETE"] * 3  # never more than --trials
    assert sum((Path(t.user_attrs["run_dir"]) / "metrics.jsonl").exists() for t in trials if "run_dir" in t.user_attrs) == 3
    assert tomllib.loads((output / "best.toml").read_text())["training"]["steps"] == 2


def test_a_trial_asked_after_other_tuners_reached_the_total_is_closed_unrun(tmp_path):
    import optuna

    from shardkit.tune.config import TuneConfig
    from shardkit.tune.report import trial_rows
    from shardkit.tune.study import StudyRun

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}", study_name="s")
    run = StudyRun(study=study, config=TuneConfig(trials=3), params=(), base_values={}, output=tmp_path)
    # Between this tuner's count of the study and its ask, other tuners asked for the 3 trials.
    for _ in range(3):
        study.ask()
    late = study.ask()
    assert run._surplus(late)
    stored = study.trials[late.number]
    assert stored.state.name == "FAIL" and stored.user_attrs["surplus"] and run.failures == 0
    assert trial_rows(study)[late.number]["note"].startswith("not run: other tuners")
