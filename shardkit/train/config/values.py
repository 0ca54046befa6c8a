"""A `TrainConfig` from option values nested by section, as a config file, the command line (through
`shardkit.train.options`), `shardkit tune` and a run's config.json give them, over the chosen preset."""

from __future__ import annotations

import dataclasses
from typing import Any

from shardkit.options import option_name
from shardkit.train.config.trainer import PRESETS, SECTIONS, TrainConfig, loop_option_sections


def nest_options(values: dict[str, Any], *, source: str = "configuration") -> dict[str, Any]:
    """`values` with the options that were `TrainConfig`'s own before it had loop sections (`steps`,
    `precision`, `compile`, ...), given at the top level as older config files and config.json hold them,
    moved into their section (`{"steps": 5}` -> `{"training": {"steps": 5}}`). Sections are copied.

    Raises:
        ValueError: an option given both at the top level and in its section, with different values.
    """
    owners = loop_option_sections()
    # `compile` names both a section and its switch: a table is the section, a value the switch.
    flat = {name: value for name, value in values.items()
            if name in owners and not (name in SECTIONS and isinstance(value, dict))}
    nested = {key: dict(value) if isinstance(value, dict) else value for key, value in values.items()
              if key not in flat}
    for name, value in flat.items():
        section = nested.setdefault(owners[name], {})
        if not isinstance(section, dict):
            continue  # config_from_dict names the section that is not a table
        if name in section and section[name] != value:
            raise ValueError(f"{source}: {name} is given twice, {value!r} at the top level and {section[name]!r} "
                             f"in section {owners[name]}: keep one")
        section[name] = value
    return nested


def config_from_dict(values: dict[str, Any], *, source: str = "configuration") -> TrainConfig:
    """Build a `TrainConfig` from nested {section: {field: value}} values over the chosen preset (the loop
    sections' options may also stand at the top level, see `nest_options`).

    Raises:
        ValueError: unknown section or field (naming it and `source`), or a failed check.
    """
    values = nest_options(values, source=source)
    top_fields = {f.name for f in dataclasses.fields(TrainConfig)} - set(SECTIONS)
    preset = values.get("preset", "tiny")
    if preset not in PRESETS:
        raise ValueError(f"{source}: --preset must be one of {sorted(PRESETS)}, got {preset!r}")
    merged: dict[str, dict[str, Any]] = {name: dict(PRESETS[preset].get(name, {})) for name in SECTIONS}
    top: dict[str, Any] = {}
    for key, value in values.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise ValueError(f"{source}: section {key!r} must be a table/object of options")
            known = {name for name, _, _ in section_options(SECTIONS[key])}
            nested = {f.name for f in dataclasses.fields(SECTIONS[key]) if f.metadata.get("flatten")}
            for name, item in value.items():
                if name not in known and not (name in nested and isinstance(item, dict)):
                    raise ValueError(f"{source}: unknown option {key}.{name} (known: {', '.join(sorted(known))})")
                merged[key][name] = item
        elif key in top_fields:
            top[key] = value
        else:
            raise ValueError(f"{source}: unknown option {key!r}")
    if merged["checkpoint"].get("model_from_checkpoint") is None:
        # Nothing said about the model: a resumed run continues the checkpoint's model, not the preset's.
        merged["checkpoint"]["model_from_checkpoint"] = not values.get("model") and "preset" not in values
    sections = {name: build_section(SECTIONS[name], merged[name], source=source) for name in SECTIONS}
    return TrainConfig(**top, **sections)


def section_options(cls: type) -> list[tuple[str, tuple[str, ...], dataclasses.Field]]:
    """(option name, attribute path, field) for each option of section `cls`.

    A field marked `flatten` holds a component's own config dataclass (e.g. `LoaderConfig`): its
    fields become options of the section, renamed where `rename` says (to keep names unique).
    """
    options = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("flatten"):
            rename = f.metadata.get("rename", {})
            options += [(rename.get(sub.name, sub.name), (f.name, sub.name), sub)
                        for sub in dataclasses.fields(f.default_factory)]
        else:
            options.append((f.name, (f.name,), f))
    return options


def build_section(cls: type, values: dict[str, Any], *, source: str = "configuration") -> Any:
    """Section `cls` from option values (flattened names, or a nested table per flattened field)."""
    paths = {name: path for name, path, _ in section_options(cls)}
    own: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        path = paths.get(name)
        if path is None:  # a nested table such as {"loader": {...}} (config.json records this form)
            nested.setdefault(name, {}).update(value)
        elif len(path) == 1:
            own[name] = value
        else:
            nested.setdefault(path[0], {})[path[1]] = value
    for f in dataclasses.fields(cls):
        if f.name in nested:
            rename = f.metadata.get("rename", {})
            try:
                own[f.name] = f.default_factory(**nested[f.name])
            except TypeError as err:
                raise ValueError(f"{source}: {err}") from err
            except ValueError as err:  # messages start with the field's name: say the option instead
                message = str(err)
                first = message.split(" ", 1)[0]
                raise ValueError(f"{option_name(rename.get(first, first))}{message[len(first):]}") from err
    return cls(**own)
