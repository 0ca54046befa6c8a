"""The tuner's own options (one frozen dataclass; `shardkit tune`'s options are generated from it).

The trainer's options sit beside these on the same command line: they are the base configuration of
every trial, and `--space` names the ones to search.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardkit.options import option, option_name

SAMPLERS = ("tpe", "random", "grid", "cmaes", "pbt")
PRUNERS = ("none", "median", "halving", "hyperband")
OBJECTIVES = ("eval_loss", "loss")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True, kw_only=True)
class TuneConfig:
    """Hyperparameter search over real trainer runs."""

    trials: int = option(20, "trials to finish (complete or pruned); a rerun continues the study up to this number")
    sampler: str = option("tpe", "'tpe' (Bayesian), 'random', 'grid', 'cmaes' (Optuna samplers) or 'pbt' "
                          "(population-based training over the trainer's checkpoints)", choices=SAMPLERS)
    pruner: str = option("median", "stop trials whose evaluations are clearly worse: 'median', 'halving' "
                         "(successive halving), 'hyperband' or 'none'", choices=PRUNERS)
    objective: str = option("eval_loss", "value to minimise: the final 'eval_loss' (needs --eval-data) or the "
                            "final training 'loss'", choices=OBJECTIVES)
    study: str = option("shardkit", "study name in the storage")
    storage: str | None = option(None, "SQLAlchemy URL of the Optuna study (e.g. postgresql://host/db for several "
                                 "machines); default sqlite:///OUTPUT/study.db")
    output: str = option("tune", "directory for the default study, the trial run directories, best.toml, "
                         "trials.csv and the plots")
    nproc_per_trial: int = option(1, "ranks per trial (torchrun --nproc_per_node); 1 runs the trainer directly")
    parallel_trials: int | None = option(None, "trials (or PBT members) running at once; default 1 (pbt: --population)")
    sampler_seed: int = option(0, "seed of the sampler (and of PBT's initial population and perturbations)")
    grid_points: int = option(3, "grid sampler: values per float or wide int range")
    prune_startup_trials: int = option(2, "median pruner: finished trials before pruning starts")
    prune_warmup_steps: int = option(0, "median pruner: steps of each trial that are never pruned")
    max_failures: int | None = option(None, "stop after this many failed trials (default --trials)")
    heartbeat_s: int = option(30, "seconds between a running trial's heartbeats in the storage; a trial of "
                              "another machine silent for 4x this long is marked failed and retried")
    population: int = option(4, "pbt: members trained side by side")
    perturb_every: int = option(0, "pbt: steps per round; after each round the bottom members copy a top "
                                "member's checkpoint and perturb its hyperparameters")
    checkpoint_root: str | None = option(None, "pbt: directory or fsspec URL (e.g. s3://bucket/pbt) of the members' "
                                         "checkpoints; tuners on several hosts sharing one --storage study give "
                                         "the same shared root; default OUTPUT/pbt")
    quantile: float = option(0.25, "pbt: fraction of the population replaced after each round (at least one)")

    def __post_init__(self) -> None:
        for name in ("trials", "nproc_per_trial", "grid_points", "heartbeat_s", "population"):
            _check(getattr(self, name) >= 1, f"{option_name(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("parallel_trials", "max_failures"):
            value = getattr(self, name)
            _check(value is None or value >= 1, f"{option_name(name)} must be >= 1, got {value}")
        _check(self.prune_startup_trials >= 0 and self.prune_warmup_steps >= 0,
               "--prune-startup-trials and --prune-warmup-steps must be >= 0")
        _check(0 < self.quantile <= 0.5, f"--quantile must be in (0, 0.5], got {self.quantile}")
        _check(bool(self.study), "--study must not be empty")
        _check(self.checkpoint_root is None or self.sampler == "pbt",
               "--checkpoint-root is where PBT members' checkpoints go: give it with --sampler pbt, or leave it out")
        if self.sampler == "pbt":
            _check(self.perturb_every >= 1, "--sampler pbt needs --perturb-every STEPS (steps per round)")
            _check(self.population >= 2, f"--sampler pbt needs --population >= 2, got {self.population}")

    @property
    def concurrency(self) -> int:
        if self.parallel_trials is not None:
            return self.parallel_trials
        return self.population if self.sampler == "pbt" else 1
