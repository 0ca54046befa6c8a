"""Population-based training over the trainer's own DCP checkpoints (Jaderberg et al., 2017), on one host or
shared by tuners on several hosts.

Members train in rounds of `--perturb-every` steps: a member's round r runs its trainer with `--steps` =
(r + 1) * S, resuming from a checkpoint of round r - 1. After a round the members are ranked by the objective
at the round's last step; each member of the bottom quantile resumes its next round from the checkpoint of a
member of the top quantile (weights, optimizer, scheduler, loader position, RNG: it continues exactly where
the source stands) with the source's hyperparameters perturbed inside the search space (exploit, then
explore). Which member exploits which, and every member's hyperparameters, follow from the seed and the
scores of the finished rounds (`pbt_plan`), so every tuner computes the same plan.

The population's state lives in the study's storage (the same `--storage` and `--study` as the Optuna
samplers; SQLite by default): each member's round is one trial, claimed under the study's lock
(`storage.study_lock`) so that no round runs twice, and its attributes (member, round, hyperparameters,
checkpoint resumed from and written, score, curve) are written only by the tuner that runs it. The
checkpoints live under `--checkpoint-root` (default OUTPUT/pbt), which tuners on several hosts share. A
killed tuner rerun with the same command continues: finished rounds are never rerun, and the round it was
running is claimed again (at once on the same host, after the heartbeat's grace on another).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardkit.storage import redact_url
from shardkit.tune import pbt_plan, report
from shardkit.tune import space as search_space
from shardkit.tune import storage as study_storage
from shardkit.tune import tomlfile
from shardkit.tune.config import TuneConfig
from shardkit.tune.pbt_checkpoints import CheckpointRoot
from shardkit.tune.runner import Launch, MetricsPorts, Outcome, run_trainer
from shardkit.tune.study import WAIT_S, Heartbeat, run_workers

logger = logging.getLogger(__name__)

# Trial attributes of a member's round; written only by the tuner that runs it.
ROUND = "pbt_round"
MEMBER = study_storage.PBT_MEMBER


def round_score(outcome: Outcome, objective: str, *, start: int, end: int) -> tuple[float, list[tuple[int, float]]]:
    """The objective at step `end` (inf when absent, not finite, or the trainer failed), and the round's curve
    (steps after `start`: the member's run directory holds the records of its earlier rounds too)."""
    curve = [(int(r["step"]), float(r[objective])) for r in outcome.records
             if objective in r and int(r["step"]) > start]
    found = [value for at, value in curve if at == end]
    score = found[-1] if found and outcome.returncode == 0 else math.inf
    return (score if math.isfinite(score) else math.inf), curve


def population_fingerprint(config: TuneConfig, params: tuple[search_space.Param, ...],
                           base_values: dict[str, Any]) -> dict[str, Any]:
    """What a tuner joining the population must agree on (checked against the study's record)."""
    return {"space": [p.spec for p in params], "trainer_options": base_values, "objective": config.objective,
            "pbt": {"population": config.population, "perturb_every": config.perturb_every,
                    "quantile": config.quantile, "sampler_seed": config.sampler_seed}}


@dataclass(frozen=True)
class _Claim:
    """A member's round this tuner took, with what the study held when it took it."""

    trial: Any
    member: int
    round_index: int
    plan: pbt_plan.Plan
    records: dict[tuple[int, int], dict[str, Any]]


@dataclass
class PopulationRun:
    """The PBT population of one study, run by this tuner together with any others sharing the study."""

    config: TuneConfig
    params: tuple[search_space.Param, ...]
    base_values: dict[str, Any]
    output: Path
    study: Any
    storage_url: str
    storage_options: str | None = None
    ports: MetricsPorts | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        root = self.config.checkpoint_root or str(self.directory)
        try:
            self.checkpoints = CheckpointRoot(root, self.storage_options)
        except (ValueError, ImportError) as err:  # an unknown protocol, or its fsspec package is not installed
            raise ValueError(f"--checkpoint-root {redact_url(root)}: {err}") from None

    @property
    def directory(self) -> Path:
        return self.output / "pbt"

    @property
    def steps(self) -> int:
        return int(search_space.training_option(self.base_values, "steps", 1000))

    @property
    def rounds(self) -> int:
        return math.ceil(self.steps / self.config.perturb_every)

    def member_dir(self, member: int) -> Path:
        return self.directory / f"member_{member:03d}"

    def member_values(self, member: int, chosen: dict[str, Any], end_step: int) -> dict[str, Any]:
        """Trainer options of one member for a round that ends at `end_step`."""
        values = search_space.apply(self.base_values, self.params, chosen)
        training = values.setdefault("training", {})
        training["steps"] = end_step
        every = self.config.perturb_every
        # An evaluation at each round's end; a constant schedule unless one was given, since `--steps`
        # (which the cosine and wsd schedules stretch over) grows round by round.
        if not training.get("eval_every") or every % int(training["eval_every"]):
            training["eval_every"] = every
        optimizer = values.setdefault("optimizer", {})
        optimizer.setdefault("schedule", "constant")
        optimizer.setdefault("warmup_steps", 0)
        values.setdefault("logging", {})["run_dir"] = str(self.member_dir(member))
        values.setdefault("checkpoint", {}).update(checkpoint_every=0, save_final=True)
        return values

    def run(self) -> dict[str, Any]:
        """Train the population's rounds that are left, with the other tuners of the study; returns the state
        (the finished rounds, the members' last hyperparameters, the lineage) once every round finished."""
        study_storage.recover_interrupted(self.study, grace_s=study_storage.GRACE_FACTOR * self.config.heartbeat_s)
        run_workers(self._worker, self.config.concurrency, self.stop)
        state = self.state()
        report.write_lineage(state["lineage"], [p.name for p in self.params], self.directory)
        return state

    def records(self) -> dict[tuple[int, int], dict[str, Any]]:
        """{(member, round): the attributes of its finished trial, with its score} as the study holds them."""
        from optuna.trial import TrialState

        found = {}
        for trial in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            attrs = trial.user_attrs
            if MEMBER in attrs:
                found[(attrs[MEMBER], attrs[ROUND])] = {**attrs, "score": trial.value, "trial": trial.number}
        return found

    def plan(self, records: dict[tuple[int, int], dict[str, Any]]) -> pbt_plan.Plan:
        scores = []
        for round_index in range(self.rounds):
            if not all((m, round_index) in records for m in range(self.config.population)):
                break
            scores.append([records[(m, round_index)]["score"] for m in range(self.config.population)])
            if all(math.isinf(s) for s in scores[-1]):
                raise RuntimeError(f"PBT: every member failed in round {round_index}; see the trial.log files "
                                   f"under {self.directory} (or those of the other tuners of the study)")
        initial = pbt_plan.initial_population(self.params, self.config.population, seed=self.config.sampler_seed)
        return pbt_plan.plan(initial, scores, self.params, quantile=self.config.quantile,
                             seed=self.config.sampler_seed, rounds=self.rounds)

    def state(self) -> dict[str, Any]:
        records = self.records()
        the_plan = self.plan(records)
        events = pbt_plan.lineage(the_plan, records, rounds=self.rounds)
        finished = len({e["round"] for e in events})
        return {"round": finished, "members": the_plan.params[min(finished, len(the_plan.params) - 1)],
                "lineage": events}

    def _worker(self) -> None:
        while not self.stop.is_set():
            claim = self.claim()
            if claim is None:
                return
            if claim == "wait":  # the next round waits for members that other tuners (or threads) train
                time.sleep(WAIT_S)
                continue
            self._run_round(claim)

    def claim(self) -> _Claim | str | None:
        """Take the first member's round that may start and nobody holds (a new trial); "wait" when all
        that may start are taken, None when the population has finished. Under the study's lock: another
        tuner's claim is never read half-written, and no round is claimed twice."""
        from optuna.trial import TrialState

        with self.lock, study_storage.study_lock(self.storage_url):
            study_storage.recover_interrupted(self.study,
                                              grace_s=study_storage.GRACE_FACTOR * self.config.heartbeat_s)
            taken = {(t.user_attrs[MEMBER], t.user_attrs[ROUND])
                     for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.COMPLETE))
                     if MEMBER in t.user_attrs}
            records = self.records()
            if len(records) >= self.config.population * self.rounds:
                return None
            the_plan = self.plan(records)
            for round_index in range(len(the_plan.params)):
                for member in range(self.config.population):
                    if (member, round_index) in taken:
                        continue
                    trial = self.study.ask()
                    trial.set_user_attr("tuner", study_storage.owner())
                    trial.set_user_attr(MEMBER, member)
                    trial.set_user_attr(ROUND, round_index)
                    self.study._storage.record_heartbeat(trial._trial_id)
                    return _Claim(trial, member, round_index, the_plan, records)
        return "wait"

    def _run_round(self, claim: _Claim) -> None:
        from optuna.trial import TrialState

        trial, member, round_index = claim.trial, claim.member, claim.round_index
        end_step = min(self.steps, (round_index + 1) * self.config.perturb_every)
        chosen = claim.plan.params[round_index][member]
        source = claim.plan.sources[round_index][member]
        run_dir = self.member_dir(member)
        resumed_from = claim.records[(source, round_index - 1)].get("checkpoint") if round_index else None
        if round_index and resumed_from is None:
            raise FileNotFoundError(f"PBT: member {source} saved no checkpoint in round {round_index - 1} (it "
                                    f"failed), so member {member} cannot resume from it")
        checkpoint_dir = self.checkpoints.directory(member, round_index, run_dir)
        values = self.member_values(member, chosen, end_step)
        values["checkpoint"].update(checkpoint_dir=str(checkpoint_dir), resume=str(
            self.checkpoints.local(resumed_from, run_dir)) if resumed_from else "none")
        for key, value in (("params", chosen), ("source", source), ("resumed_from", resumed_from),
                           ("run_dir", str(run_dir)), ("step", end_step)):
            trial.set_user_attr(key, value)
        logger.info("PBT round %d: member %d%s: %s", round_index, member,
                    f" resumes from {resumed_from}" if resumed_from else "", chosen)
        outcome = run_trainer(Launch(run_dir=run_dir, values=values, nproc=self.config.nproc_per_trial,
                                     storage_options=self.storage_options, ports=self.ports),
                              stop=self.stop, tick=Heartbeat(self.study, trial, self.config.heartbeat_s))
        trial.set_user_attr("wall_s", round(outcome.seconds, 3))
        if outcome.stopped:  # the tuner is stopping: the round is claimed again by the next tuner
            trial.set_user_attr("interrupted", True)
            self.study.tell(trial, state=TrialState.FAIL)
            return
        score, curve = round_score(outcome, self.config.objective, start=round_index * self.config.perturb_every,
                                   end=end_step)
        if outcome.returncode != 0:
            logger.warning("PBT member %d failed (status %d), ranked last; the end of %s:\n%s", member,
                           outcome.returncode, outcome.log, outcome.tail())
        checkpoint = self.checkpoints.publish(member, round_index, checkpoint_dir) if math.isfinite(score) else None
        trial.set_user_attr("checkpoint", checkpoint)
        trial.set_user_attr("curve", curve)
        self.study.tell(trial, score)

    def curves(self) -> dict[int, list[tuple[int, float]]]:
        """Each member's objective over all rounds, wherever they ran (from the study)."""
        result: dict[int, list[tuple[int, float]]] = {}
        for (member, _), record in sorted(self.records().items(), key=lambda item: (item[0][1], item[0][0])):
            result.setdefault(member, []).extend(tuple(point) for point in record.get("curve", []))
        return result

    def write_best(self, state: dict[str, Any], path: Path) -> Path:
        """best.toml: the final best member's hyperparameters over the whole run. PBT's result is a
        schedule of hyperparameters (see lineage.json); this is its last point, as one config."""
        last = [e for e in state["lineage"] if e["round"] == state["round"] - 1]
        best = min(last, key=lambda e: (e["score"], e["member"]))
        values = report.best_values(self.member_values(best["member"], best["params"], self.steps))
        header = (f"PBT: best member {best['member']} at step {best['step']}: {self.config.objective} "
                  f"{best['score']!r}\nits hyperparameters changed during training; lineage.json has the "
                  "schedule")
        return tomlfile.write(path, values, header=header)
