"""`shardkit tune --sampler pbt`: a population of 3 real trainer runs over 3 rounds."""

from __future__ import annotations

import csv
import json

import pytest

from tune_helpers import (kill_tuner_during_second_trial, load_study, make_datasets, metrics, run_tune, study_rows,
                          trainer_args)

pytestmark = pytest.mark.slow


def test_pbt_exploit_copies_checkpoints_and_explore_stays_in_the_space(tmp_path):
    datasets = make_datasets(tmp_path / "data")
    output = tmp_path / "tune"
    result = run_tune(*trainer_args(datasets, tmp_path / "cache", steps=12, eval_every=4),
                      "--space", "lr=loguniform:1e-3:3e-2", "--sampler", "pbt", "--population", "3",
                      "--perturb-every", "4", "--quantile", "0.34", "--output", str(output), timeout=240)
    lineage = json.loads((output / "pbt" / "lineage.json").read_text())
    assert [(e["round"], e["member"]) for e in lineage] == [(r, m) for r in range(3) for m in range(3)]
    exploits = [e for e in lineage if e["action"] == "exploit"]
    assert len(exploits) == 2  # one bottom member per round (quantile 0.34 of 3), none after the last round
    member_dir = lambda m: output / "pbt" / f"member_{m:03d}"  # noqa: E731
    for event in exploits:
        member, source, step = event["member"], event["source"], event["step"]
        scores = {e["member"]: e["score"] for e in lineage if e["round"] == event["round"]}
        assert scores[member] == max(scores.values()) and scores[source] == min(scores.values())
        assert scores[member] == [r["eval_loss"] for r in metrics(member_dir(member))
                                  if "eval_loss" in r and r["step"] == step][0]
        # The copy continues exactly where the source stands: same weights, same next batch, so the
        # first loss after the copy (computed before the update) is the source's own next loss.
        after = {m: next(r for r in metrics(member_dir(m)) if r["step"] == step + 1 and "loss" in r)
                 for m in (member, source)}
        assert after[member]["loss"] == after[source]["loss"]
        # Explore: the source's lr scaled by 0.8 or 1.2 (clipped to the space), and the copy trains with it.
        new_lr = event["new_params"]["lr"]
        source_lr = next(e["params"]["lr"] for e in lineage if e["round"] == event["round"] and e["member"] == source)
        assert 1e-3 <= new_lr <= 3e-2
        assert new_lr in (min(3e-2, max(1e-3, source_lr * f)) for f in (0.8, 1.2))
        assert after[member]["lr"] == new_lr  # constant schedule, no warm-up under PBT
        assert after[source]["lr"] == source_lr
        next_round = next(e for e in lineage if e["round"] == event["round"] + 1 and e["member"] == member)
        assert next_round["params"] == event["new_params"]
    for event in lineage:
        assert 1e-3 <= event["params"]["lr"] <= 3e-2
    with open(output / "pbt" / "lineage.csv") as handle:
        assert len(list(csv.DictReader(handle))) == 9
    assert (output / "population.png").stat().st_size > 0
    assert "lr = " in (output / "best.toml").read_text()
    assert "member" in result.stdout


def test_a_run_directory_whose_earlier_trainer_still_runs_is_waited_for(tmp_path, caplog):
    """A tuner SIGKILLed leaves its trainers running; its rerun must not start a second trainer in the same
    member directory until the first one has exited."""
    import json
    import subprocess
    import sys
    import time

    from shardkit.tune.runner import OWNER_NAME, Launch, run_trainer
    from shardkit.tune.storage import owner
    datasets = make_datasets(tmp_path / "data")
    member = tmp_path / "member_000"
    member.mkdir()
    earlier = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(4)"])  # the orphaned trainer
    (member / OWNER_NAME).write_text(json.dumps(owner(earlier.pid)))
    train, evaluation = datasets
    values = {"steps": 2, "device": "cpu", "optimizer": {"warmup_steps": 1},
              "data": {"data": train, "batch_size": 4, "cache_dir": str(tmp_path / "cache")},
              "logging": {"run_dir": str(member), "tensorboard": False, "log_every": 1000}}
    started = time.monotonic()
    with caplog.at_level("WARNING"):
        outcome = run_trainer(Launch(run_dir=member, values=values))
    waited = time.monotonic() - started - outcome.seconds
    assert earlier.poll() is not None and outcome.returncode == 0, outcome.tail()
    assert waited >= 2, f"the second trainer started while the first ran (waited {waited:.1f}s)"
    assert f"waiting for trainer pid {earlier.pid}" in caplog.text
    assert json.loads((member / OWNER_NAME).read_text())["pid"] != earlier.pid  # the new trainer is recorded


def test_a_killed_pbt_tuner_rerun_trains_each_members_round_once(tmp_path):
    """The population lives in the study: a tuner SIGKILLed mid-round, rerun, claims that round again (the
    killed trial is failed, not enqueued) and never reruns a finished one."""
    datasets = make_datasets(tmp_path / "data")
    output = tmp_path / "tune"
    # Rounds of 6 steps: the kill must land while the second trial trains, which a round of 2 steps on a loaded
    # machine could finish between two polls of the study.
    args = [*trainer_args(datasets, tmp_path / "cache", steps=12, eval_every=6), "--space",
            "lr=loguniform:1e-3:3e-2", "--sampler", "pbt", "--population", "2", "--perturb-every", "6",
            "--parallel-trials", "1", "--output", str(output)]

    def states() -> list[str]:
        return [row[1] for row in study_rows(output)] if (output / "study.db").exists() else []

    # One tuner slot: trial n is member n % 2's round n // 2; killed while member 1 trains round 0.
    kill_tuner_during_second_trial(args, output, states,
                                   metrics_of=lambda n: output / "pbt" / f"member_{n % 2:03d}" / "metrics.jsonl")
    run_tune(*args, timeout=240)
    trials = load_study(output).trials
    killed = trials[1]
    assert killed.state.name == "FAIL" and killed.user_attrs["interrupted"]
    assert (killed.user_attrs["pbt_member"], killed.user_attrs["pbt_round"]) == (1, 0)
    complete = [(t.user_attrs["pbt_member"], t.user_attrs["pbt_round"]) for t in trials if t.state.name == "COMPLETE"]
    assert sorted(complete) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert not [t for t in trials if t.state.name in ("RUNNING", "WAITING")]
    assert trials[0].state.name == "COMPLETE"  # finished before the kill, never rerun
    lineage = json.loads((output / "pbt" / "lineage.json").read_text())
    assert sorted((e["member"], e["round"]) for e in lineage) == sorted(complete)
