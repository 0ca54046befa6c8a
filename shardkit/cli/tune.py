"""`shardkit tune`: hyperparameter search over real trainer runs (Optuna samplers and pruners, or PBT).

The trainer's options given here are every trial's base configuration; `--space` names the ones to
search. Light imports only: Optuna and torch load when the command runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardkit.options import Namespace, add_command, add_dataclass_options, option, option_group, option_name


@dataclass(frozen=True, kw_only=True)
class SpaceOptions:
    space: tuple[str, ...] = option((), "a trainer option to search, e.g. lr=loguniform:1e-4:1e-2, "
                                        "warmup_steps=int:0:200, dropout=uniform:0:0.2, schedule=choice:cosine,wsd "
                                        "(repeat for several)", metavar="NAME=KIND:ARGS", cli_default="none")


def register(subparsers: Any) -> None:
    from shardkit.train.options import add_train_arguments
    from shardkit.tune.config import TuneConfig

    parser = add_command(
        subparsers, "tune", _tune, help="search hyperparameters over real trainer runs (TPE, random, grid, CMA-ES, PBT)",
        allow_abbrev=False,  # --storage must never be read as an abbreviation of --storage-options
        usage="shardkit tune --data URL --eval-data URL --space NAME=KIND:ARGS [--space ...] [--trials N] "
              "[--sampler S] [trainer options]",
        description="Run trainer trials with hyperparameters drawn from --space, in an Optuna study stored in "
                    "a database (default OUTPUT/study.db; a rerun continues it), or train a population with "
                    "--sampler pbt. Writes trials.csv, best.toml (a trainer --config) and PNG plots to "
                    "--output. See docs/TUNING.md.")
    group = option_group(parser, "tuning")
    add_dataclass_options(group, SpaceOptions)
    add_dataclass_options(group, TuneConfig)
    add_train_arguments(parser)


def _values(args: Namespace, skip: set[str]) -> tuple[dict[str, Any], str | None]:
    """The trainer options given (`--config` file, then the command line), nested by section, and
    `--storage-options` apart (it may hold credentials: it never goes into a file)."""
    from shardkit.train.options import option_values

    from shardkit.train.__main__ import STORAGE_OPTIONS_ENV

    from shardkit.options import parse_storage_options

    values = option_values(args, skip=skip)
    secret = values.get("data", {}).pop("storage_options", None) or os.environ.get(STORAGE_OPTIONS_ENV)
    # One JSON text for the trials' environment, whatever form was given (a --config table, KEY=VALUE).
    return values, json.dumps(parse_storage_options(secret)) if secret else None


def _prepare(args: Namespace):
    from shardkit.train.config import config_from_dict
    from shardkit.tune.config import TuneConfig
    from shardkit.tune.runner import MetricsPorts
    from shardkit.tune.space import check_against_trainer, parse_space

    names = {f.name for f in dataclasses.fields(TuneConfig)}
    config = TuneConfig(**{k: v for k, v in vars(args).items() if k in names})
    space = getattr(args, "space", [])
    if not space:
        raise ValueError("give at least one --space NAME=KIND:ARGS (e.g. --space lr=loguniform:1e-4:1e-2)")
    params = parse_space(space)
    values, secret = _values(args, names | {"space", "config", "func", "command"})
    base = config_from_dict(values, source="trainer options")
    if not base.data.data:
        raise ValueError("--data is required: the URL of the training dataset")
    if config.objective == "eval_loss" and not base.data.eval_data:
        raise ValueError("--objective eval_loss needs --eval-data (a held-out dataset), or use --objective loss")
    training = values.setdefault("training", {})
    if config.sampler != "pbt" and config.pruner != "none" and "eval_every" not in training:
        # The pruner compares trials at intermediate evaluations: without --eval-every, derive them from --steps.
        training["eval_every"] = max(1, base.training.steps // 10)
        base = config_from_dict(values, source="trainer options")
        print(f"shardkit tune: no --eval-every given: trials evaluate every {training['eval_every']} steps (--steps "
              f"{base.training.steps} / 10) for --pruner {config.pruner}; pass --eval-every N, or --pruner none to "
              "evaluate only at the end", file=sys.stderr)
    if config.sampler != "pbt" and config.pruner != "none" and not base.training.eval_every:
        raise ValueError(f"--pruner {config.pruner} needs --eval-every N (intermediate results to prune on), "
                         "or use --pruner none")
    if config.sampler == "pbt" and any(p.name == "steps" for p in params):
        raise ValueError("--sampler pbt sets --steps round by round: it cannot be searched")
    model_options = [p.name for p in params if p.section == "model"]
    if config.sampler == "pbt" and model_options:
        raise ValueError(f"--sampler pbt copies checkpoints between members, so it cannot search model options "
                         f"({', '.join(option_name(n) for n in model_options)}): a member's checkpoint would go into a "
                         "different model; search them with --sampler tpe, random or grid")
    check_against_trainer(params, values)
    ports = MetricsPorts(base.logging.metrics_port, slots=config.concurrency, nproc=config.nproc_per_trial)
    return config, params, values, secret, ports


def _tune(args: Namespace) -> int:
    import logging
    import warnings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = None
    try:
        config, params, values, secret, ports = _prepare(args)
        output = Path(config.output)
        output.mkdir(parents=True, exist_ok=True)
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        # The heartbeat is recorded by the runner here (ask-and-tell), which Optuna does not expect.
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
        if config.sampler == "pbt":
            return _run_pbt(config, params, values, secret, ports, output)
        return _run_study(config, params, values, secret, ports, output)
    except (ValueError, TypeError, OSError) as err:
        print(f"shardkit tune: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # trials kept failing
        print(f"shardkit tune: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # Optuna's and SQLAlchemy's errors share no builtin base
        from shardkit.tune.storage import default_url, storage_full

        full = config and storage_full(err, config.storage or default_url(Path(config.output)))
        if not full:
            raise
        print(f"shardkit tune: error: {full}", file=sys.stderr)
        return 2


def _open_study(config, output: Path, fingerprint: dict[str, Any], **kwargs: Any):
    """The study `--study` in `--storage` (created by the first tuner), checked against `fingerprint`."""
    import optuna

    from shardkit.tune.storage import default_url, open_storage
    from shardkit.tune.study import check_fingerprint

    storage = open_storage(config.storage or default_url(output), heartbeat_s=config.heartbeat_s)
    study = optuna.create_study(study_name=config.study, storage=storage, direction="minimize", load_if_exists=True,
                                **kwargs)
    check_fingerprint(study, fingerprint)
    return study


def _run_study(config, params, values, secret, ports, output: Path) -> int:
    from shardkit.tune import plots, report
    from shardkit.tune.space import training_option
    from shardkit.tune.study import StudyRun, make_pruner, make_sampler

    study = _open_study(config, output, {"space": [p.spec for p in params], "trainer_options": values,
                                         "objective": config.objective},
                        pruner=make_pruner(config, steps=int(training_option(values, "steps", 1000)),
                                           eval_every=int(training_option(values, "eval_every", 0)) or 1))
    # Seeded by the trials already there: a continued study does not redraw the first run's values.
    study.sampler = make_sampler(config, params, seed=config.sampler_seed + len(study.trials))
    try:
        StudyRun(study=study, config=config, params=params, base_values=values, output=output,
                 storage_options=secret, ports=ports).run()
    finally:
        rows = report.trial_rows(study)
        print(report.format_table(rows))
        try:  # the reports are written whole or not at all (a full disk keeps the previous ones)
            written = [report.write_csv(rows, output / "trials.csv"),
                       report.write_best(study, output / "best.toml", objective=config.objective),
                       plots.plot_history(study, output / "history.png", objective=config.objective),
                       plots.plot_importances(study, output / "importances.png")]
        except OSError as err:
            print(f"shardkit tune: error: {err}", file=sys.stderr)
        else:
            for path in filter(None, written):
                print(f"wrote {path}")
    return 0


def _run_pbt(config, params, values, secret, ports, output: Path) -> int:
    from shardkit.tune import plots
    from shardkit.tune.pbt import PopulationRun, population_fingerprint
    from shardkit.tune.report import format_table
    from shardkit.tune.storage import default_url

    study = _open_study(config, output, population_fingerprint(config, params, values))
    population = PopulationRun(config=config, params=params, base_values=values, output=output, study=study,
                               storage_url=config.storage or default_url(output), storage_options=secret,
                               ports=ports)
    state = population.run()
    last = [e for e in state["lineage"] if e["round"] == state["round"] - 1]
    rows = [{"member": e["member"], "objective": e["score"], **e["params"]} for e in last]
    print(format_table(sorted(rows, key=lambda r: r["objective"])))
    best = population.write_best(state, output / "best.toml")
    exploits = [e for e in state["lineage"] if e["action"] == "exploit"]
    curves = plots.plot_population(population.curves(), exploits, output / "population.png",
                                   objective=config.objective)
    for path in (population.directory / "lineage.json", population.directory / "lineage.csv", best, curves):
        if path:
            print(f"wrote {path}")
    return 0
