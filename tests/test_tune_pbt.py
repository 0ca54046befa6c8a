"""`shardkit tune --sampler pbt`: a population of 3 real trainer runs over 3 rounds."""

from __future__ import annotations

import csv
import json

import pytest

from tune_helpers import make_datasets, metrics, run_tune, trainer_args

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
