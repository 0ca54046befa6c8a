"""`shardkit tune --sampler pbt` shared by two tuners (as two hosts): one population in one study, each tuner
with its own --output and one shared --checkpoint-root: a real PostgreSQL server with a shared directory, and
a SQLite file with an S3 bucket (moto), where the tuners share no checkpoint directory at all."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from conftest import S3_TEST_CREDENTIALS
from postgres_server import new_database, postgres  # noqa: F401  (postgres: the server fixture)
from tune_helpers import make_datasets, metrics, trainer_args, tune_command, tune_env

pytestmark = pytest.mark.slow

POPULATION, STEPS, EVERY = 2, 4, 2
ROUNDS = STEPS // EVERY


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    return make_datasets(tmp_path_factory.mktemp("tune-pbt-shared-data"))


def _is_checkpoint(root: str, name: str, options: dict) -> bool:
    """Whether checkpoint `name` is complete (its marker written) under the root, local or on S3."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(f"{root}/{name}/shardkit-checkpoint.json", **options)
    return fs.exists(path)


@pytest.mark.parametrize("database,checkpoints", [("postgresql", "directory"), ("sqlite", "s3")])
def test_two_tuners_train_one_population_from_each_others_checkpoints(database, checkpoints, datasets, tmp_path,
                                                                      request):
    url = (new_database(request.getfixturevalue("postgres"), "pbt") if database == "postgresql"
           else f"sqlite:///{tmp_path / 'shared' / 'study.db'}")
    (tmp_path / "shared").mkdir()
    if checkpoints == "s3":
        bucket, options = request.getfixturevalue("s3_bucket")
        root, secret, env = f"{bucket}/pbt", ["--storage-options", json.dumps(options)], {**tune_env(), **S3_TEST_CREDENTIALS}
    else:
        root, secret, env = str(tmp_path / "shared" / "checkpoints"), [], tune_env()
    common = [*secret, *trainer_args(datasets, tmp_path / "cache", steps=STEPS, eval_every=EVERY),
              "--space", "lr=loguniform:1e-3:3e-2", "--sampler", "pbt", "--population", str(POPULATION),
              "--perturb-every", str(EVERY), "--quantile", "0.5", "--parallel-trials", "1",
              "--storage", url, "--checkpoint-root", root]
    outputs = {host: tmp_path / f"host-{host}" for host in "ab"}
    tuners = [subprocess.Popen(tune_command(*common, "--output", str(output)), env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for output in outputs.values()]
    logs = [tuner.communicate(timeout=240)[0] for tuner in tuners]
    assert [tuner.returncode for tuner in tuners] == [0, 0], "\n".join(log[-3000:] for log in logs)

    import optuna

    trials = optuna.load_study(study_name="shardkit", storage=url).trials
    # Exactly one finished trial per member and round, none failed, none left running.
    assert Counter(t.state.name for t in trials) == {"COMPLETE": POPULATION * ROUNDS}, [
        (t.number, t.state.name, t.user_attrs) for t in trials]
    rounds = {(t.user_attrs["pbt_member"], t.user_attrs["pbt_round"]): t for t in trials}
    assert sorted(rounds) == [(m, r) for m in range(POPULATION) for r in range(ROUNDS)]

    # One population: both tuners report the same lineage, built from the study.
    lineages = [json.loads((output / "pbt" / "lineage.json").read_text()) for output in outputs.values()]
    assert lineages[0] == lineages[1]
    lineage = {(e["member"], e["round"]): e for e in lineages[0]}
    assert sorted(lineage) == sorted(rounds)

    def host(run_dir: str) -> str:
        return next(h for h, output in outputs.items() if Path(run_dir).is_relative_to(output))

    ran_on = {key: host(trial.user_attrs["run_dir"]) for key, trial in rounds.items()}
    assert set(ran_on.values()) == {"a", "b"}, f"one tuner trained every round: {ran_on}"
    crossings = []
    for (member, round_index), trial in rounds.items():
        if round_index == 0:
            assert trial.user_attrs["resumed_from"] is None
            continue
        before = lineage[(member, round_index - 1)]
        source = before["source"] if before["action"] == "exploit" else member
        written = rounds[(source, round_index - 1)]
        # A round resumes from the checkpoint its source wrote, wherever that ran, and says so.
        assert trial.user_attrs["resumed_from"] == written.user_attrs["checkpoint"] is not None
        assert _is_checkpoint(root, written.user_attrs["checkpoint"], options if checkpoints == "s3" else {})
        assert lineage[(member, round_index)]["resumed_from"] == written.user_attrs["checkpoint"]
        resumed = [r for r in metrics(trial.user_attrs["run_dir"])
                   if "resumed_from" in r and r["step"] == before["step"]]
        assert resumed, f"member {member} round {round_index} did not resume at step {before['step']}"
        if ran_on[(member, round_index)] != ran_on[(source, round_index - 1)]:
            crossings.append((member, round_index, source, before["action"]))
    # Both round-1 members resume from round-0 checkpoints written by both tuners' members, so at least one
    # round continues on one host from a checkpoint the other host wrote.
    assert crossings, f"no round resumed from the other tuner's checkpoint: {ran_on}"
    assert [e for e in lineage.values() if e["action"] == "exploit"]

    # No member trained a step twice (a round run by both tuners would log its steps in both output directories).
    for member in range(POPULATION):
        steps = [r["step"] for output in outputs.values()
                 if (output / "pbt" / f"member_{member:03d}" / "metrics.jsonl").exists()
                 for r in metrics(output / "pbt" / f"member_{member:03d}") if "loss" in r]
        assert sorted(steps) == list(range(1, STEPS + 1)), (member, steps)
