"""Population-based training over the trainer's own DCP checkpoints (Jaderberg et al., 2017).

Members train side by side in rounds of `--perturb-every` steps: round r runs each member's trainer
with `--steps` = (r + 1) * S, resuming from the member's newest checkpoint. After a round the members
are ranked by the objective at the round's last step; each member of the bottom quantile copies the
checkpoint of a member of the top quantile (weights, optimizer, scheduler, loader position, RNG: the
whole DCP directory, so it continues exactly where the source stands) and perturbs the source's
hyperparameters inside the search space (exploit, then explore). Every decision goes to the lineage.

The population's state (round, each member's hyperparameters, the lineage, copies still to make) is
`OUTPUT/pbt/state.json`, replaced atomically, so a killed tuner rerun with the same command continues:
a member that finished the round resumes from its checkpoint at the round's end and trains no step.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import random
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardkit.train.checkpoint import checkpoint_name
from shardkit.train.plot import read_metrics
from shardkit.tune import space as search_space
from shardkit.tune import tomlfile
from shardkit.tune.config import TuneConfig
from shardkit.tune.report import best_values
from shardkit.tune.runner import Launch, MetricsPorts, run_trainer

logger = logging.getLogger(__name__)

STATE_VERSION = 1


def _write_json(path: Path, data: Any) -> None:
    tomlfile.write_text(path, json.dumps(data, indent=1) + "\n")


def copy_checkpoint(source_dir: Path, target_dir: Path, step: int) -> None:
    """Make the source member's checkpoint of `step` the target member's only checkpoint (idempotent)."""
    source = source_dir / "checkpoints" / checkpoint_name(step)
    if not source.is_dir():
        raise FileNotFoundError(f"PBT: {source} is missing; the member it belongs to did not reach step {step}")
    incoming = target_dir / "checkpoints.incoming"
    shutil.rmtree(incoming, ignore_errors=True)
    shutil.copytree(source, incoming / source.name)
    shutil.rmtree(target_dir / "checkpoints", ignore_errors=True)
    os.replace(incoming, target_dir / "checkpoints")


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


@dataclass
class PopulationRun:
    """One PBT population in `output/pbt`."""

    config: TuneConfig
    params: tuple[search_space.Param, ...]
    base_values: dict[str, Any]
    output: Path
    storage_options: str | None = None
    ports: MetricsPorts | None = None

    @property
    def directory(self) -> Path:
        return self.output / "pbt"

    @property
    def steps(self) -> int:
        return int(self.base_values.get("steps", 1000))

    @property
    def rounds(self) -> int:
        return math.ceil(self.steps / self.config.perturb_every)

    def member_dir(self, member: int) -> Path:
        return self.directory / f"member_{member:03d}"

    def member_values(self, member: int, chosen: dict[str, Any], end_step: int) -> dict[str, Any]:
        """Trainer options of one member for a round that ends at `end_step`."""
        values = search_space.apply(self.base_values, self.params, chosen)
        values["steps"] = end_step
        every = self.config.perturb_every
        # An evaluation at each round's end; a constant schedule unless one was given, since `--steps`
        # (which the cosine and wsd schedules stretch over) grows round by round.
        if not values.get("eval_every") or every % int(values["eval_every"]):
            values["eval_every"] = every
        optimizer = values.setdefault("optimizer", {})
        optimizer.setdefault("schedule", "constant")
        optimizer.setdefault("warmup_steps", 0)
        values.setdefault("logging", {})["run_dir"] = str(self.member_dir(member))
        values.setdefault("checkpoint", {}).update(resume="auto", checkpoint_every=0, save_final=True)
        return values

    def fingerprint(self) -> dict[str, Any]:
        return {"space": [p.spec for p in self.params], "trainer_options": self.base_values,
                "population": self.config.population, "perturb_every": self.config.perturb_every,
                "quantile": self.config.quantile, "sampler_seed": self.config.sampler_seed}

    def load_state(self) -> dict[str, Any]:
        path = self.directory / "state.json"
        if path.exists():
            state = json.loads(path.read_text())
            if state.get("version") != STATE_VERSION or state.get("fingerprint") != self.fingerprint():
                raise ValueError(f"{path} belongs to a population started with other options "
                                 "(space, trainer options, population, perturb_every, quantile or seed); "
                                 "rerun with the same options or choose another --output")
            return state
        rng = random.Random(self.config.sampler_seed)
        members = [search_space.sample(self.params, rng) for _ in range(self.config.population)]
        state = {"version": STATE_VERSION, "fingerprint": self.fingerprint(), "round": 0,
                 "members": members, "pending_copies": [], "lineage": []}
        self.directory.mkdir(parents=True, exist_ok=True)
        _write_json(path, state)
        return state

    def run(self) -> dict[str, Any]:
        """Train all rounds (or the ones left); returns the final state."""
        state = self.load_state()
        self._finish_copies(state)
        while state["round"] < self.rounds:
            round_index = state["round"]
            end_step = min(self.steps, (round_index + 1) * self.config.perturb_every)
            scores = self._train_round(state["members"], end_step)
            events = [{"round": round_index, "step": end_step, "member": m, "params": state["members"][m],
                       "score": scores[m], "action": "continue"} for m in range(self.config.population)]
            members = [dict(p) for p in state["members"]]
            copies = []
            if round_index + 1 < self.rounds:
                rng = random.Random(f"{self.config.sampler_seed}-{round_index}")
                decisions = exploit_and_explore(dict(enumerate(scores)), dict(enumerate(members)), self.params,
                                                quantile=self.config.quantile, rng=rng)
                for member, (source, perturbed) in sorted(decisions.items()):
                    events[member].update(action="exploit", source=source, source_score=scores[source],
                                          new_params=perturbed)
                    members[member] = perturbed
                    copies.append({"source": source, "member": member, "step": end_step})
                    logger.info("PBT round %d: member %d (%.4g) copies member %d (%.4g): %s", round_index, member,
                                scores[member], source, scores[source], perturbed)
            state.update(round=round_index + 1, members=members, pending_copies=copies,
                         lineage=state["lineage"] + events)
            _write_json(self.directory / "state.json", state)
            self._finish_copies(state)
            self.write_lineage(state)
        self.write_lineage(state)
        return state

    def _finish_copies(self, state: dict[str, Any]) -> None:
        if not state["pending_copies"]:
            return
        for copy in state["pending_copies"]:
            copy_checkpoint(self.member_dir(copy["source"]), self.member_dir(copy["member"]), copy["step"])
        state["pending_copies"] = []
        _write_json(self.directory / "state.json", state)

    def _train_round(self, members: list[dict[str, Any]], end_step: int) -> list[float]:
        def train(member: int) -> float:
            launch = Launch(run_dir=self.member_dir(member), values=self.member_values(member, members[member], end_step),
                            nproc=self.config.nproc_per_trial, storage_options=self.storage_options,
                            ports=self.ports)
            outcome = run_trainer(launch)
            if outcome.returncode != 0:
                logger.warning("PBT member %d failed (status %d), ranked last; the end of %s:\n%s", member,
                               outcome.returncode, outcome.log, outcome.tail())
                return math.inf
            score = self.score(member, end_step)
            return score if math.isfinite(score) else math.inf

        with ThreadPoolExecutor(min(self.config.concurrency, len(members)), thread_name_prefix="member") as pool:
            scores = list(pool.map(train, range(len(members))))
        if all(math.isinf(s) for s in scores):
            raise RuntimeError(f"PBT: every member failed in the round ending at step {end_step}; "
                               f"see {self.member_dir(0) / 'trial.log'}")
        return scores

    def score(self, member: int, step: int) -> float:
        """The member's objective at `step`, from its metrics.jsonl (inf when absent)."""
        key = self.config.objective
        records, evals = read_metrics(self.member_dir(member))
        found = [r[key] for r in (evals if key == "eval_loss" else records) if r["step"] == step]
        return float(found[-1]) if found else math.inf

    def curves(self) -> dict[int, list[tuple[int, float]]]:
        key = self.config.objective
        result = {}
        for member in range(self.config.population):
            try:
                records, evals = read_metrics(self.member_dir(member))
            except (OSError, ValueError):
                continue
            result[member] = [(r["step"], r[key]) for r in (evals if key == "eval_loss" else records)]
        return result

    def write_lineage(self, state: dict[str, Any]) -> None:
        """lineage.json (every event) and lineage.csv (one row per member and round)."""
        _write_json(self.directory / "lineage.json", state["lineage"])
        names = [p.name for p in self.params]
        with open(self.directory / "lineage.csv", "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["round", "step", "member", *names, "score", "action", "source", "source_score",
                             *(f"new_{n}" for n in names)])
            for event in state["lineage"]:
                new = event.get("new_params", {})
                writer.writerow([event["round"], event["step"], event["member"],
                                 *(event["params"][n] for n in names), event["score"], event["action"],
                                 event.get("source", ""), event.get("source_score", ""),
                                 *(new.get(n, "") for n in names)])

    def write_best(self, state: dict[str, Any], path: Path) -> Path:
        """best.toml: the final best member's hyperparameters over the whole run. PBT's result is a
        schedule of hyperparameters (see lineage.json); this is its last point, as one config."""
        last = [e for e in state["lineage"] if e["round"] == state["round"] - 1]
        best = min(last, key=lambda e: (e["score"], e["member"]))
        values = best_values(self.member_values(best["member"], best["params"], self.steps))
        header = (f"PBT: best member {best['member']} at step {best['step']}: {self.config.objective} "
                  f"{best['score']!r}\nits hyperparameters changed during training; lineage.json has the "
                  "schedule")
        return tomlfile.write(path, values, header=header)
