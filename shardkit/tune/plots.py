"""PNG plots of a study: optimisation history, parameter importances, and PBT's population curves."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: works without a display
    import matplotlib.pyplot as plt

    return plt


def plot_history(study, path: Path, *, objective: str) -> Path | None:
    """Each finished trial's objective (pruned ones at their last report) and the best so far."""
    from optuna.trial import TrialState

    points = [(t.number, t.value if t.value is not None else _last_report(t), t.state)
              for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))]
    points = [p for p in points if p[1] is not None and math.isfinite(p[1])]
    if not points:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for state, marker, label in ((TrialState.COMPLETE, "o", "complete"), (TrialState.PRUNED, "x", "pruned (last report)")):
        chosen = [(n, v) for n, v, s in points if s == state]
        if chosen:
            ax.scatter(*zip(*chosen), marker=marker, label=label)
    complete = sorted((n, v) for n, v, s in points if s == TrialState.COMPLETE)
    if complete:
        best, xs, ys = math.inf, [], []
        for number, value in complete:
            best = min(best, value)
            xs.append(number)
            ys.append(best)
        ax.step(xs, ys, where="post", color="black", label="best so far")
    ax.set_xlabel("trial")
    ax.set_ylabel(objective)
    ax.set_title(f"optimisation history of study {study.study_name!r}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _last_report(trial) -> float | None:
    if not trial.intermediate_values:
        return None
    return trial.intermediate_values[max(trial.intermediate_values)]


def param_importances(study) -> dict[str, float]:
    """Optuna's fANOVA importances; PED-ANOVA where fANOVA's scikit-learn is not installed."""
    import optuna

    try:
        return optuna.importance.get_param_importances(study)
    except ImportError:
        return optuna.importance.get_param_importances(
            study, evaluator=optuna.importance.PedAnovaImportanceEvaluator())


def plot_importances(study, path: Path) -> Path | None:
    """A bar per searched parameter; None when the study cannot tell yet (fewer than two complete trials)."""
    try:
        importances = param_importances(study)
    except (ValueError, RuntimeError) as err:
        logger.info("no parameter importances yet: %s", err)
        return None
    if not importances:
        return None
    plt = _pyplot()
    names = list(importances)[::-1]
    fig, ax = plt.subplots(figsize=(7, 1.5 + 0.5 * len(names)))
    ax.barh(names, [importances[n] for n in names])
    ax.set_xlabel("importance (share of the objective's variance)")
    ax.set_title("parameter importances")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_population(curves: dict[int, list[tuple[int, float]]], exploits: list[dict[str, Any]],
                    path: Path, *, objective: str) -> Path | None:
    """PBT: each member's objective over steps; a marker where a member copied another one."""
    if not any(curves.values()):
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for member, points in sorted(curves.items()):
        if points:
            ax.plot(*zip(*points), marker=".", label=f"member {member}")
    for event in exploits:
        ax.annotate(f"{event['source']}->{event['member']}", (event["step"], event["source_score"]),
                    fontsize=7, alpha=0.7)
        ax.scatter([event["step"]], [event["source_score"]], marker="*", color="black", zorder=3)
    ax.set_xlabel("step")
    ax.set_ylabel(objective)
    ax.set_title("population-based training (stars: exploit, source->member)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
