"""The PBT plan: every tuner sharing a population derives the same hyperparameters and checkpoint sources from
the seed and the finished rounds' scores, in any process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from shardkit.tune.pbt_plan import initial_population, lineage, plan
from shardkit.tune.space import parse_space

SPACE = ["lr=loguniform:1e-4:1e-1", "schedule=choice:constant,cosine"]
SCORES = [[3.0, 1.0, 2.0, float("inf")], [1.0, 2.5, 2.0, 3.0]]


def _plan(rounds: int = 3):
    space = parse_space(SPACE)
    return plan(initial_population(space, 4, seed=7), SCORES, space, quantile=0.25, seed=7, rounds=rounds)


def test_each_round_follows_from_the_last_rounds_scores():
    the_plan = _plan()
    assert len(the_plan.params) == 3 and the_plan.sources[0] == [None] * 4
    for round_index, scores in enumerate(SCORES):
        worst = max(range(4), key=lambda m: (scores[m], m))
        best = min(range(4), key=lambda m: (scores[m], m))
        assert the_plan.decisions[round_index].keys() == {worst}
        assert the_plan.sources[round_index + 1] == [best if m == worst else m for m in range(4)]
        for member in range(4):
            if member != worst:  # a member that does not exploit keeps its hyperparameters and its checkpoint
                assert the_plan.params[round_index + 1][member] == the_plan.params[round_index][member]
        assert the_plan.params[round_index + 1][worst] == the_plan.decisions[round_index][worst][1]
    # No decision after the last round: it has no next round to start.
    assert len(_plan(rounds=2).params) == 2 and len(_plan(rounds=2).decisions) == 1


def test_the_plan_is_the_same_in_every_process():
    """Tuners on other hosts compute it anew: nothing may depend on the process (hash seed, set order)."""
    code = ("import json, sys; sys.path.insert(0, 'tests'); from test_tune_pbt_plan import _plan; "
            "p = _plan(); print(json.dumps([p.params, p.sources]))")
    outputs = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                              capture_output=True, text=True, check=True).stdout for seed in ("1", "2")}
    assert len(outputs) == 1
    assert json.loads(outputs.pop()) == json.loads(json.dumps([_plan().params, _plan().sources]))


def test_lineage_says_who_exploited_whom_from_which_checkpoint():
    the_plan = _plan()
    records = {(m, r): {"score": SCORES[r][m], "step": 2 * (r + 1), "trial": 4 * r + m,
                        "checkpoint": f"member_{m:03d}/round_{r:03d}/step_{2 * (r + 1):08d}",
                        "resumed_from": None if r == 0 else
                        f"member_{the_plan.sources[r][m]:03d}/round_{r - 1:03d}/step_{2 * r:08d}"}
               for r in range(2) for m in range(4)}
    events = lineage(the_plan, records, rounds=3)
    assert [(e["round"], e["member"]) for e in events] == [(r, m) for r in range(2) for m in range(4)]
    exploit = next(e for e in events if e["action"] == "exploit" and e["round"] == 0)
    assert (exploit["member"], exploit["source"], exploit["source_score"]) == (3, 1, 1.0)
    assert exploit["new_params"] == the_plan.params[1][3]
    assert next(e for e in events if e["round"] == 1 and e["member"] == 3)["resumed_from"] == \
        "member_001/round_000/step_00000002"
