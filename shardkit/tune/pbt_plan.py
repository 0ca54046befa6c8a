"""The population's plan and lineage: pure functions of the search space, the seed and the finished rounds.

Which hyperparameters each member trains with in a round, and whose checkpoint it resumes from, follow from
the initial population (drawn with `--sampler-seed`) and the scores of the rounds before it (exploit and
explore draw from a generator seeded by the seed and the round). Every tuner sharing a population computes
the same plan from the scores the study holds, so a decision is never written by one tuner and read by
another: the study only records what each member's round did, written by the tuner that ran it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from shardkit.tune import space as search_space


def initial_population(space: tuple[search_space.Param, ...], size: int, *, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [search_space.sample(space, rng) for _ in range(size)]


def exploit_and_explore(scores: dict[int, float], params: dict[int, dict[str, Any]],
                        space: tuple[search_space.Param, ...], *, quantile: float,
                        rng: random.Random) -> dict[int, tuple[int, dict[str, Any]]]:
    """{bottom member: (top member it copies, its perturbed hyperparameters)} (a pure function)."""
    ranked = sorted(scores, key=lambda member: (scores[member], member))
    count = max(1, int(len(ranked) * quantile))
    top, bottom = ranked[:count], ranked[-count:]
    decisions = {}
    for member in bottom:
        source = rng.choice(top)
        decisions[member] = (source, search_space.perturb(params[source], space, rng))
    return decisions


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Per round (those that may start now), per member: its hyperparameters and the member whose
    checkpoint of the round before it resumes from (itself unless it exploits; None in round 0); and the
    exploit decisions taken after each finished round."""

    params: list[list[dict[str, Any]]]
    sources: list[list[int | None]]
    decisions: list[dict[int, tuple[int, dict[str, Any]]]]


def plan(initial: list[dict[str, Any]], scores: list[list[float]], space: tuple[search_space.Param, ...], *,
         quantile: float, seed: int, rounds: int) -> Plan:
    """The plan for the rounds that may start: round 0, and the round after each finished one.

    Args:
        initial: the members' hyperparameters in round 0.
        scores: per finished round (0, 1, ... in order), each member's objective at the round's end.
        rounds: how many rounds the population trains.
    """
    params, sources, decisions = [initial], [[None] * len(initial)], []
    for round_index, round_scores in enumerate(scores):
        if round_index + 1 >= rounds:
            break
        rng = random.Random(f"{seed}-{round_index}")
        chosen = exploit_and_explore(dict(enumerate(round_scores)), dict(enumerate(params[-1])), space,
                                     quantile=quantile, rng=rng)
        decisions.append(chosen)
        params.append([chosen[m][1] if m in chosen else dict(p) for m, p in enumerate(params[-1])])
        sources.append([chosen[m][0] if m in chosen else m for m in range(len(initial))])
    return Plan(params=params, sources=sources, decisions=decisions)


def lineage(the_plan: Plan, records: dict[tuple[int, int], dict[str, Any]], *, rounds: int) -> list[dict[str, Any]]:
    """Every member in every finished round: hyperparameters, score, where it ran and from which checkpoint,
    and for an exploit the source member, its score and the new hyperparameters.

    Args:
        records: {(member, round): what its finished round recorded}: "score", "step", and optionally
            "trial", "run_dir", "checkpoint", "resumed_from".
    """
    size = len(the_plan.params[0])
    events = []
    for round_index in range(rounds):
        if not all((m, round_index) in records for m in range(size)):
            break
        decided = the_plan.decisions[round_index] if round_index < len(the_plan.decisions) else {}
        for member in range(size):
            record = records[(member, round_index)]
            event = {"round": round_index, "step": record["step"], "member": member,
                     "params": the_plan.params[round_index][member], "score": record["score"],
                     "action": "continue"}
            event.update({k: record[k] for k in ("trial", "run_dir", "checkpoint", "resumed_from") if k in record})
            if member in decided:
                source, new_params = decided[member]
                event.update(action="exploit", source=source, source_score=records[(source, round_index)]["score"],
                             new_params=new_params)
            events.append(event)
    return events
