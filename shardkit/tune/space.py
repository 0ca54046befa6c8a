"""The search space: `--space NAME=KIND:ARGS` parsed into `Param`s, checked against the trainer's options.

    lr=loguniform:1e-4:1e-2      a float drawn on a log scale
    dropout=uniform:0:0.2        a float drawn on a linear scale
    warmup_steps=int:0:200       an integer (both ends included)
    schedule=choice:cosine,wsd   one of the listed values (converted to the option's type)

NAME is any trainer option, short (`lr`) or with its section (`optimizer.lr`). Everything here is a pure
function of its arguments: sampling and perturbing take the random generator they use.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Any

from shardkit.train.config import SECTIONS, TrainConfig, config_from_dict, nest_options
from shardkit.options import option_name, parse_bool

KINDS = ("loguniform", "uniform", "int", "choice")
# Options the tuner sets itself for every trial: searching them would break its bookkeeping.
RESERVED = {"run_dir", "checkpoint_dir", "resume", "storage_options", "data", "eval_data"}


@dataclass(frozen=True, kw_only=True)
class Param:
    """One searched option. `key` is (section or None, field name): where the value goes in the config."""

    name: str
    section: str | None
    kind: str
    low: float | None = None
    high: float | None = None
    choices: tuple[Any, ...] = ()

    @property
    def spec(self) -> str:
        if self.kind == "choice":
            return f"{self.name}=choice:" + ",".join(str(c) for c in self.choices)
        return f"{self.name}={self.kind}:{self.low:g}:{self.high:g}"

    def contains(self, value: Any) -> bool:
        if self.kind == "choice":
            return value in self.choices
        if self.kind == "int" and int(value) != value:
            return False
        return self.low <= value <= self.high


def _fields() -> dict[str, tuple[str | None, dataclasses.Field]]:
    """Every trainer option's field name -> (its section, the field); names are unique across sections."""
    found: dict[str, tuple[str | None, dataclasses.Field]] = {
        f.name: (None, f) for f in dataclasses.fields(TrainConfig) if f.name not in SECTIONS}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if f.metadata.get("flatten"):  # e.g. the loader's options, given as --shuffle-window, --data-seed
                rename = f.metadata.get("rename", {})
                found.update({rename.get(g.name, g.name): (section, g) for g in dataclasses.fields(f.default_factory)})
            else:
                found[f.name] = (section, f)
    return found


def _number(text: str, spec: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"--space {spec!r}: {text!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"--space {spec!r}: bounds must be finite, got {text!r}")
    return value


def _convert_choice(text: str, field_type: str, spec: str) -> Any:
    base = field_type.replace("| None", "").strip()
    try:
        return {"int": int, "float": float, "str": str, "bool": parse_bool}[base](text.strip())
    except (ValueError, TypeError) as err:  # parse_bool's OptionValueError is a ValueError
        raise ValueError(f"--space {spec!r}: choice {text!r} is not a valid {base}") from err


def parse_param(spec: str) -> Param:
    """Parse one `NAME=KIND:ARGS`; raises ValueError naming the spec and what is wrong with it."""
    name, sep, rest = spec.partition("=")
    kind, _, args = rest.partition(":")
    name, kind = name.strip().replace("-", "_"), kind.strip()  # the option's name (warmup-steps) or its field's
    if not sep or not name or kind not in KINDS or not args:
        raise ValueError(f"--space {spec!r}: expected NAME=KIND:ARGS with KIND one of {', '.join(KINDS)} "
                         "(e.g. lr=loguniform:1e-4:1e-2, warmup_steps=int:0:200, schedule=choice:cosine,wsd)")
    section, _, field_name = name.rpartition(".")
    known = _fields()
    if field_name not in known or (section and known[field_name][0] != section):
        raise ValueError(f"--space {spec!r}: unknown trainer option {name!r} "
                         "(see 'shardkit train --help' for the options)")
    if field_name in RESERVED:
        raise ValueError(f"--space {spec!r}: {option_name(field_name)} is set by the tuner for each trial and cannot be searched")
    section, field = known[field_name]
    field_type = str(field.type)
    if kind == "choice":
        choices = tuple(_convert_choice(c, field_type, spec) for c in args.split(","))
        if len(set(choices)) != len(choices):
            raise ValueError(f"--space {spec!r}: a choice is listed twice")
        return Param(name=field_name, section=section, kind=kind, choices=choices)
    bounds = args.split(":")
    if len(bounds) != 2:
        raise ValueError(f"--space {spec!r}: {kind} takes LOW:HIGH, got {args!r}")
    low, high = (_number(b, spec) for b in bounds)
    if field_type.startswith("bool") or field_type.startswith("str"):
        raise ValueError(f"--space {spec!r}: {option_name(field_name)} is a {field_type} option: use choice:A,B")
    if kind in ("uniform", "loguniform") and field_type.startswith("int"):
        raise ValueError(f"--space {spec!r}: {option_name(field_name)} takes integers: use int:LOW:HIGH")
    if kind == "int" and (low != int(low) or high != int(high)):
        raise ValueError(f"--space {spec!r}: int bounds must be integers")
    if not low < high:
        raise ValueError(f"--space {spec!r}: LOW must be smaller than HIGH")
    if kind == "loguniform" and low <= 0:
        raise ValueError(f"--space {spec!r}: loguniform needs LOW > 0")
    return Param(name=field_name, section=section, kind=kind, low=low, high=high)


def parse_space(specs: list[str] | tuple[str, ...]) -> tuple[Param, ...]:
    params = tuple(parse_param(spec) for spec in specs)
    names = [p.name for p in params]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--space: {', '.join(twice)} given more than once")
    return params


def training_option(values: dict[str, Any], name: str, default: Any) -> Any:
    """An option of the trainer's training section (`steps`, `eval_every`, ...) in option values (nested, or
    with the section's options at the top level as a study started before the section existed holds them)."""
    return nest_options(values).get("training", {}).get(name, default)


def apply(values: dict[str, Any], params: tuple[Param, ...], chosen: dict[str, Any]) -> dict[str, Any]:
    """Nested trainer option values with the chosen hyperparameters set (a new dict; options given at the top
    level that belong to a section are moved into it, see `nest_options`)."""
    merged = nest_options(values)
    for param in params:
        if param.section is None:
            merged[param.name] = chosen[param.name]
        else:
            merged.setdefault(param.section, {})[param.name] = chosen[param.name]
    return merged


def check_against_trainer(params: tuple[Param, ...], values: dict[str, Any]) -> None:
    """Build the trainer's configuration at each bound and choice, so that a value the trainer refuses
    (e.g. `--lr` <= 0) fails here, before any trial starts, with the trainer's own message."""
    for param in params:
        edges = param.choices if param.kind == "choice" else (param.low, param.high)
        for edge in edges:
            value = int(edge) if param.kind == "int" else edge
            try:
                config_from_dict(apply(values, (param,), {param.name: value}), source="trainer options")
            except (ValueError, TypeError) as err:
                raise ValueError(f"--space {param.spec!r}: at {param.name}={value}: {err}") from None


def sample(params: tuple[Param, ...], rng: random.Random) -> dict[str, Any]:
    """A point drawn from the space (PBT's initial population)."""
    chosen: dict[str, Any] = {}
    for param in params:
        if param.kind == "choice":
            chosen[param.name] = rng.choice(param.choices)
        elif param.kind == "int":
            chosen[param.name] = rng.randint(int(param.low), int(param.high))
        elif param.kind == "loguniform":
            chosen[param.name] = math.exp(rng.uniform(math.log(param.low), math.log(param.high)))
        else:
            chosen[param.name] = rng.uniform(param.low, param.high)
    return chosen


def perturb(chosen: dict[str, Any], params: tuple[Param, ...], rng: random.Random, *,
            factors: tuple[float, float] = (0.8, 1.2), resample_probability: float = 0.25) -> dict[str, Any]:
    """PBT's explore step: scale numbers by one of `factors`, clipped to the space; a choice is redrawn
    with `resample_probability` (as in Jaderberg et al. 2017 and Ray Tune's PBT)."""
    result = dict(chosen)
    for param in params:
        value = chosen[param.name]
        if param.kind == "choice":
            if rng.random() < resample_probability:
                result[param.name] = rng.choice(param.choices)
            continue
        scaled = min(param.high, max(param.low, value * rng.choice(factors)))
        if param.kind == "int":
            # Rounding could undo a small change; move at least one step in the chosen direction.
            rounded = round(scaled)
            if rounded == value and scaled != value:
                rounded = value + (1 if scaled > value else -1)
            scaled = int(min(param.high, max(param.low, rounded)))
        result[param.name] = scaled
    return result


def grid(params: tuple[Param, ...], points: int) -> dict[str, list[Any]]:
    """The grid sampler's values: choices as listed, ranges as `points` evenly spaced values
    (log-spaced for loguniform; every integer when the range holds no more than `points`)."""
    values: dict[str, list[Any]] = {}
    for param in params:
        if param.kind == "choice":
            values[param.name] = list(param.choices)
        elif param.kind == "int" and param.high - param.low + 1 <= points:
            values[param.name] = list(range(int(param.low), int(param.high) + 1))
        else:
            fractions = [i / (points - 1) for i in range(points)] if points > 1 else [0.5]
            if param.kind == "loguniform":
                span = math.log(param.high) - math.log(param.low)
                line = [min(param.high, max(param.low, math.exp(math.log(param.low) + f * span))) for f in fractions]
            else:
                line = [param.low + f * (param.high - param.low) for f in fractions]
            values[param.name] = sorted({round(v) for v in line}) if param.kind == "int" else line
    return values


def suggest(trial, params: tuple[Param, ...]) -> dict[str, Any]:
    """Ask an Optuna trial for a value of every parameter."""
    chosen: dict[str, Any] = {}
    for param in params:
        if param.kind == "choice":
            chosen[param.name] = trial.suggest_categorical(param.name, list(param.choices))
        elif param.kind == "int":
            chosen[param.name] = trial.suggest_int(param.name, int(param.low), int(param.high))
        else:
            chosen[param.name] = trial.suggest_float(param.name, param.low, param.high,
                                                     log=param.kind == "loguniform")
    return chosen
