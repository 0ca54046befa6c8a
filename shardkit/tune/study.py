"""An Optuna study over real trainer runs: samplers, pruners, and the ask / run / tell loop.

The loop uses Optuna's ask-and-tell interface rather than `study.optimize`, because a trial here is a
subprocess the tuner follows: each evaluation the trainer writes is reported to the trial as it
appears, and a trial the pruner stops is terminated and told PRUNED. The study ends when it holds
`--trials` finished (COMPLETE or PRUNED) trials, counted in the storage, so a rerun after a crash,
or several tuners sharing one storage, stop at the same total.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardkit.train.config import config_from_dict, nest_options
from shardkit.tune import space as search_space
from shardkit.tune import storage as study_storage
from shardkit.tune.config import TuneConfig
from shardkit.tune.runner import Launch, MetricsPorts, Outcome, run_trainer

logger = logging.getLogger(__name__)

WAIT_S = 1.0  # how often a tuner with nothing to start looks again at the study


def make_sampler(config: TuneConfig, params: tuple[search_space.Param, ...], *, seed: int):
    import optuna

    if config.sampler == "tpe":
        # Fewer random start-up trials than Optuna's 10 for short studies, so TPE gets to model something.
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(10, max(2, config.trials // 3)))
    if config.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if config.sampler == "grid":
        return optuna.samplers.GridSampler(search_space.grid(params, config.grid_points), seed=seed)
    if config.sampler == "cmaes":
        try:
            import cmaes  # noqa: F401  (Optuna's CmaEsSampler imports it only when sampling)
        except ImportError:
            raise ValueError("--sampler cmaes needs the cmaes package: pip install 'shardkit[tune]'") from None
        return optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
    raise ValueError(f"--sampler {config.sampler} is not an Optuna sampler")


def make_pruner(config: TuneConfig, *, steps: int, eval_every: int):
    import optuna

    if config.pruner == "none":
        return optuna.pruners.NopPruner()
    if config.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=config.prune_startup_trials,
                                           n_warmup_steps=config.prune_warmup_steps)
    if config.pruner == "halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=eval_every)
    return optuna.pruners.HyperbandPruner(min_resource=eval_every, max_resource=steps)


def check_fingerprint(study, fingerprint: dict[str, Any]) -> None:
    """A study continues only with the command that started it: refuse other trainer options or space."""
    for key, value in fingerprint.items():
        stored = study.user_attrs.get(key)
        if key == "trainer_options":
            # Compared in their sectioned shape: a study started before the trainer had a training section holds
            # its options at the top level, and a tuner may be given them either way (`steps` or `training.steps`).
            value = nest_options(value)
            stored = nest_options(stored) if stored is not None else None
        if stored is None:
            study.set_user_attr(key, value)
        elif stored != value:
            differing = (sorted(k for k in set(stored) | set(value) if stored.get(k) != value.get(k))
                         if isinstance(value, dict) else [])
            raise ValueError(f"study {study.study_name!r} was started with another {key.replace('_', ' ')}"
                             + (f" (differs in: {', '.join(differing)})" if differing else
                                f": {stored} (now {value})")
                             + "; rerun with the same options, or choose another --study")


def run_workers(worker: Callable[[], None], count: int, stop: threading.Event) -> None:
    """Run `count` copies of `worker` in threads until all return; on the first error (or Ctrl-C) set `stop`,
    so that the others terminate their trainers and mark their trials, wait for them, and raise it."""
    with ThreadPoolExecutor(count, thread_name_prefix="trial") as pool:
        futures = [pool.submit(worker) for _ in range(count)]
        try:
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for future in done:
                future.result()  # re-raise a worker's error (too many failures)
        except BaseException:
            stop.set()
            wait(futures)
            raise


@dataclasses.dataclass
class StudyRun:
    """One tuner process working on a study: its settings and what it has in flight."""

    study: Any
    config: TuneConfig
    params: tuple[search_space.Param, ...]
    base_values: dict[str, Any]
    output: Path
    storage_options: str | None = None
    ports: MetricsPorts | None = None
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)
    mine: set[int] = dataclasses.field(default_factory=set)
    failures: int = 0
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def steps(self) -> int:
        return int(search_space.training_option(self.base_values, "steps", 1000))

    @property
    def eval_every(self) -> int:
        return int(search_space.training_option(self.base_values, "eval_every", 0))

    @property
    def target(self) -> int:
        """Finished trials the study needs: `--trials`, or fewer when a grid has fewer points."""
        if self.config.sampler != "grid":
            return self.config.trials
        return min(self.config.trials, math.prod(map(len, search_space.grid(self.params,
                                                                           self.config.grid_points).values())))

    def _tell(self, trial, *args: Any, **kwargs: Any) -> None:
        """`study.tell`. Optuna's grid sampler calls `study.stop()` from it once every grid point is done,
        which raises outside `study.optimize` after the trial is stored: the grid's end, not an error."""
        try:
            self.study.tell(trial, *args, **kwargs)
        except RuntimeError as err:
            if "Study.stop" not in str(err):
                raise

    def run(self) -> None:
        """Run trials until the study holds `--trials` finished ones (several at once with threads)."""
        study_storage.recover_interrupted(self.study, grace_s=study_storage.GRACE_FACTOR * self.config.heartbeat_s)
        run_workers(self._worker, self.config.concurrency, self.stop)

    def _next_trial(self):
        """Ask for a trial if the study still needs one; None when this worker should end, "wait" when
        trials of other tuners may still fail and need a replacement."""
        from optuna.trial import TrialState

        with self.lock:
            study_storage.recover_interrupted(self.study,
                                              grace_s=study_storage.GRACE_FACTOR * self.config.heartbeat_s)
            trials = self.study.get_trials(deepcopy=False)
            finished = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
            elsewhere = sum(t.state == TrialState.RUNNING and t.number not in self.mine for t in trials)
            if finished + len(self.mine) >= self.target:
                return None
            if finished + len(self.mine) + elsewhere >= self.target:
                return "wait"
            trial = self.study.ask()
            if self._surplus(trial):
                return "wait"
            self.mine.add(trial.number)
        trial.set_user_attr("tuner", study_storage.owner())
        self.study._storage.record_heartbeat(trial._trial_id)
        return trial

    def _surplus(self, trial) -> bool:
        """Whether trials numbered before `trial` (finished or running, in any tuner) already make the study's
        total: tuners sharing a study may all ask at once, and the storage numbers their trials in one order,
        so the later ones step back. A surplus trial is closed unrun, marked so (not a failure)."""
        from optuna.trial import TrialState

        before = sum(t.number < trial.number and t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
                     for t in self.study.get_trials(deepcopy=False))
        if before < self.target:
            return False
        trial.set_user_attr("surplus", True)
        self._tell(trial, state=TrialState.FAIL)
        return True

    def _worker(self) -> None:
        while not self.stop.is_set():
            trial = self._next_trial()
            if trial is None:
                return
            if trial == "wait":
                time.sleep(WAIT_S)
                continue
            try:
                self._run_trial(trial)
            finally:
                with self.lock:
                    self.mine.discard(trial.number)

    def _fail(self, trial, reason: str, *, counts: bool = True) -> None:
        from optuna.trial import TrialState

        trial.set_user_attr("error", reason[-2000:])
        self._tell(trial, state=TrialState.FAIL)
        logger.warning("trial %d failed: %s", trial.number, reason)
        if not counts:
            return
        with self.lock:
            self.failures += 1
            failures = self.failures
        limit = self.config.max_failures or self.config.trials
        if failures >= limit:
            raise RuntimeError(f"{failures} trials failed (limit --max-failures {limit}); the last: "
                               f"trial {trial.number}: {reason}")

    def _run_trial(self, trial) -> None:
        from optuna.trial import TrialState

        chosen = search_space.suggest(trial, self.params)
        run_dir = self.output / "trials" / f"trial_{trial.number:05d}"
        values = search_space.apply(self.base_values, self.params, chosen)
        trial.set_user_attr("trainer_config", values)
        trial.set_user_attr("run_dir", str(run_dir))
        try:
            config_from_dict(values, source=f"trial {trial.number}")
        except (ValueError, TypeError) as err:  # a combination of values the trainer refuses
            self._fail(trial, str(err))
            return
        values = search_space.apply(values, (), {})  # a copy: trainer_config above stays without run_dir
        values.setdefault("logging", {})["run_dir"] = str(run_dir)
        logger.info("trial %d: %s", trial.number, ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                            for k, v in chosen.items()))
        heartbeat = Heartbeat(self.study, trial, self.config.heartbeat_s)
        pruned: list[int] = []

        def on_record(record: dict[str, Any]) -> bool:
            value = self._intermediate(record)
            if value is None:
                return False
            step, loss = value
            trial.report(loss, step)
            if step < self.steps and self.config.pruner != "none" and trial.should_prune():
                pruned.append(step)
                return True
            return False

        outcome = run_trainer(Launch(run_dir=run_dir, values=values, nproc=self.config.nproc_per_trial,
                                     storage_options=self.storage_options, ports=self.ports),
                              on_record=on_record, stop=self.stop, tick=heartbeat)
        trial.set_user_attr("wall_s", round(outcome.seconds, 3))
        if pruned:
            trial.set_user_attr("pruned_at_step", pruned[0])
            trial.set_user_attr("stopped_early", outcome.stopped and outcome.returncode != 0)
            self._tell(trial, state=TrialState.PRUNED)
            logger.info("trial %d pruned at step %d (%.1fs)", trial.number, pruned[0], outcome.seconds)
            return
        if outcome.stopped:  # the tuner is stopping: retry this trial's parameters next time
            trial.set_user_attr("interrupted", True)
            self._fail(trial, "interrupted: the tuner was stopped", counts=False)
            study_storage.retry_failed(self.study, self.study._storage.get_trial(trial._trial_id))
            return
        self._tell_final(trial, outcome)

    def _intermediate(self, record: dict[str, Any]) -> tuple[int, float] | None:
        """(step, value) when `record` carries the objective: every eval_loss, or the training loss at
        each --eval-every step."""
        key = self.config.objective
        if key not in record:
            return None
        step = int(record["step"])
        if key == "loss" and not (step == self.steps or (self.eval_every and step % self.eval_every == 0)):
            return None
        return step, float(record[key])

    def _tell_final(self, trial, outcome: Outcome) -> None:
        if outcome.returncode != 0:
            self._fail(trial, f"the trainer exited with status {outcome.returncode}; the end of "
                              f"{outcome.log}:\n{outcome.tail()}")
            return
        final = [value for step, value in filter(None, map(self._intermediate, outcome.records))
                 if step == self.steps]
        if not final:
            self._fail(trial, f"no {self.config.objective} at step {self.steps} in "
                              f"{outcome.log.parent / 'metrics.jsonl'}")
            return
        if not math.isfinite(final[-1]):
            self._fail(trial, f"{self.config.objective} is {final[-1]} at step {self.steps}")
            return
        self._tell(trial, final[-1])
        logger.info("trial %d: %s %.6g (%.1fs)", trial.number, self.config.objective, final[-1], outcome.seconds)


class Heartbeat:
    """Records the trial's heartbeat in the storage every `interval_s` (called from the runner's poll)."""

    def __init__(self, study, trial, interval_s: float):
        self.study, self.trial, self.interval_s = study, trial, interval_s
        self.last = time.monotonic()

    def __call__(self) -> None:
        if time.monotonic() - self.last >= self.interval_s:
            self.study._storage.record_heartbeat(self.trial._trial_id)
            self.last = time.monotonic()
