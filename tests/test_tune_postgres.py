"""`shardkit tune` on a shared PostgreSQL study, as tuners on several hosts run it: a real PostgreSQL
server (private, on loopback) holds one study that two tuner processes work on at once (each with its
own output directory, as on two machines); and a tuner SIGKILLed mid-trial and restarted recovers it."""

from __future__ import annotations

import functools
import subprocess

import pytest

from postgres_server import new_database, postgres  # noqa: F401  (postgres: the server fixture)
from tune_helpers import kill_tuner_during_second_trial, make_datasets, run_tune, trainer_args, tune_command, tune_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    return make_datasets(tmp_path_factory.mktemp("tune-pg-data"))


@functools.cache
def _storage(url: str):
    """One Optuna storage per database: `kill_tuner_during_second_trial` polls every 0.1 s, and a storage made
    per call (`load_study(storage=url)`) kept its pooled connection open, so a slow trial (a loaded machine)
    exhausted the server's 100 connections ("too many clients already"). Made under the tuners' lock: it creates
    the tables when the tuner has not yet, and two CREATE TABLEs at once fail on PostgreSQL ("duplicate key value
    violates unique constraint pg_type_typname_nsp_index", in the tuner or here)."""
    import optuna

    from shardkit.tune.storage import study_lock

    with study_lock(url):
        return optuna.storages.RDBStorage(url)


def _trials(url: str, study: str = "shardkit"):
    import optuna

    return optuna.load_study(study_name=study, storage=_storage(url)).trials


def test_two_tuners_share_one_study_and_stop_at_n_trials(postgres, datasets, tmp_path):
    url = new_database(postgres, "shared")
    common = [*trainer_args(datasets, tmp_path / "cache", steps=4, eval_every=2),
              "--space", "lr=loguniform:1e-4:1e-2", "--trials", "5", "--sampler", "random",
              "--pruner", "none", "--storage", url]
    hosts = [subprocess.Popen(tune_command(*common, "--output", str(tmp_path / f"host-{h}")), env=tune_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for h in "ab"]
    outputs = [host.communicate(timeout=300)[0] for host in hosts]
    assert [host.returncode for host in hosts] == [0, 0], "\n".join(o[-3000:] for o in outputs)

    trials = _trials(url)
    finished = [t for t in trials if t.state.name == "COMPLETE"]
    assert len(finished) == 5, [(t.number, t.state.name) for t in trials]
    assert not [t for t in trials if t.state.name == "RUNNING"]
    run_dirs = [t.user_attrs["run_dir"] for t in trials if "run_dir" in t.user_attrs]
    assert len(run_dirs) == len(set(run_dirs)), "a trial ran twice in one directory"
    # Both hosts worked on the study: each one's output holds the runs of the trials it took.
    by_host = {h: {t.number for t in finished if t.user_attrs["run_dir"].startswith(str(tmp_path / f"host-{h}"))}
               for h in "ab"}
    assert by_host["a"] and by_host["b"] and not by_host["a"] & by_host["b"], by_host
    assert by_host["a"] | by_host["b"] == {t.number for t in finished}


def test_tuner_killed_mid_trial_on_postgres_recovers_it(postgres, datasets, tmp_path):
    url = new_database(postgres, "killed")
    output = tmp_path / "tune"
    args = [*trainer_args(datasets, tmp_path / "cache", steps=30, eval_every=10),
            "--space", "lr=loguniform:1e-3:1e-2", "--trials", "3", "--sampler", "random",
            "--pruner", "none", "--storage", url, "--output", str(output)]
    def states() -> list[str]:
        try:
            return [t.state.name for t in _trials(url)]
        except KeyError:  # the study does not exist yet
            return []

    kill_tuner_during_second_trial(args, output, states)
    before = _trials(url)
    interrupted = before[-1]
    assert interrupted.state.name == "RUNNING"

    run_tune(*args, timeout=300)
    trials = _trials(url)
    assert len([t for t in trials if t.state.name == "COMPLETE"]) == 3
    failed = trials[interrupted.number]
    assert failed.state.name == "FAIL" and failed.user_attrs["interrupted"]
    retries = [t for t in trials if t.user_attrs.get("retry_of") == interrupted.number]
    assert len(retries) == 1 and retries[0].params == failed.params and retries[0].state.name == "COMPLETE"
