"""Command-line options generated one-to-one from the configuration dataclasses.

Each field `NAME` of section `SECTION` is `--NAME` and `--SECTION.NAME`, spelled in kebab-case
(`--min-lr-ratio`, `--optimizer.min-lr-ratio`, `--mixed-precision.loss-scale`; `shardkit.options` accepts the
snake_case alias); its help is the field's help text, and `--help` groups the options by section. `--config FILE`
(JSON or TOML, nested like `TrainConfig`; the loop sections' options may stand at its top level, as files written
before those sections hold them) is read first, then the options given on the command line override it, over the
chosen `--preset`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardkit.options import (Namespace, add_dataclass_options, add_field_option, command_parser, option, option_group,
                              option_name)
from shardkit.train.config import PRESETS, SECTIONS, TrainConfig, config_from_dict, nest_options, section_options


@dataclass(frozen=True, kw_only=True)
class ConfigFileOption:
    """Read before the command line, which overrides it."""

    config: str | None = option(None, "JSON or TOML file of options, nested by section like the options below; "
                                      "command-line options override it", metavar="FILE")


def _with_presets(default: Any, section: str | None, name: str) -> Any:
    """The default as `--help` states it: a field the presets set shows the default preset's value and
    every preset's (read from `PRESETS`, so the help cannot drift from what a run uses)."""
    if section is None and name == "preset":
        return f"{default}; " + "; ".join(
            f"{preset} = " + " ".join(f"{option_name(key)} {value}" for values in table.values() for key, value in values.items())
            for preset, table in PRESETS.items())
    by_preset = {preset: table[section][name] for preset, table in PRESETS.items()
                 if name in table.get(section or "", {})}
    if not by_preset:
        return default
    chosen = TrainConfig.__dataclass_fields__["preset"].default
    others = ", ".join(f"{preset} {value}" for preset, value in by_preset.items() if preset != chosen)
    if chosen in by_preset:
        return f"{by_preset[chosen]}, set by --preset {chosen}; other presets: {others}"
    return f"{default}; --preset {others}"


def add_field(group: Any, f: dataclasses.Field, section: str | None,
              name: str | None = None) -> None:
    """The option of one trainer field (`--NAME`, and `--SECTION.NAME` for a section's field), its default
    in `--help` stated with the presets that change it."""
    add_field_option(group, f, name=name, section=section, default_text=_with_presets(
        f.default if f.default is not dataclasses.MISSING else None, section, f.name))


def add_train_arguments(parser: Any) -> None:
    """Add `--config` and one option per configuration field to `parser`."""
    add_dataclass_options(parser, ConfigFileOption)
    top = option_group(parser, "preset")
    for f in dataclasses.fields(TrainConfig):
        if f.name not in SECTIONS:
            add_field(top, f, None)
    for section, cls in SECTIONS.items():
        group = option_group(parser, section, cls.__doc__)
        for name, _, f in section_options(cls):
            add_field(group, f, section, name)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a JSON (`.json`) or TOML (any other suffix) configuration file into a nested dict."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise OSError(f"cannot read --config {path}: {err.strerror or err}") from err
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import tomllib
            data = tomllib.loads(text)
    except ValueError as err:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        raise ValueError(f"--config {path}: not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected an object/table at the top level")
    return data


def option_values(args: Namespace, *, skip: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
    """The `--config FILE` values overlaid with the options given on the command line, nested by section
    (the input of `config_from_dict`); `skip` names parser destinations that are not trainer options."""
    values: dict[str, Any] = load_config_file(args.config) if getattr(args, "config", None) else {}
    # A file may give the loop sections' options at the top level (`steps = 50`): nested first, so that the
    # command line's --steps (training.steps) overrides it.
    values = nest_options(values, source=f"--config {args.config}") if values else {}
    for dest, value in vars(args).items():
        if dest in {"config", "func", "command", *skip}:
            continue
        if isinstance(value, list):  # an option given several values (nargs)
            value = ",".join(value)
        section, _, name = dest.rpartition(".")
        (values.setdefault(section, {}) if section else values)[name] = value
    return values


def config_from_args(args: Namespace) -> TrainConfig:
    """Merge preset, `--config FILE` and command-line options into a validated `TrainConfig`."""
    source = f"--config {args.config} and the command line" if getattr(args, "config", None) else "command line"
    return config_from_dict(option_values(args), source=source)


def parse_train_args(argv: list[str] | None = None, *, prog: str = "python -m shardkit.train") -> TrainConfig:
    parser = command_parser(
        prog=prog, usage="%(prog)s --data URL [--config FILE] [--OPTION VALUE ...]", description="Pre-train a GPT-style model on a shardkit dataset. Launch with "
        "'torchrun --nproc_per_node N -m shardkit.train --data URL [options]' for several processes.")
    add_train_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return config_from_args(args)
    except (ValueError, TypeError) as err:
        parser.error(str(err))
        raise  # unreachable: parser.error exits
