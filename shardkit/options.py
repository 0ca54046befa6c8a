"""Command-line options generated from configuration dataclasses: the one machine every command uses.

A configuration field declared with `option(...)` carries its help, allowed values, parser and value
name in `metadata`; `add_field_option` turns one such field into one argparse option and
`add_dataclass_options` does it for a whole dataclass. The build (`BuildConfig`), the loader
(`LoaderConfig`, through the trainer), the trainer (`TrainConfig`), `shardkit tune` (`TuneConfig`) and
`shardkit trace` (`TraceConfig`) all go through them, so every option is spelled the same way:

- **kebab-case**: field `cache_limit` is `--cache-limit`. The snake_case spelling of any option is
  accepted as an alias by `OptionParser`, which respells `--a_b` as `--a-b` before parsing, so scripts
  written for the old spelling keep working; `--help` lists only the kebab-case names.
- **booleans**: `--NAME [BOOL]` (true/false, yes/no, 1/0, on/off; alone: true) and `--no-NAME`; commands
  with positional lists (build, trace) take them as plain flags `--NAME` / `--no-NAME`.
- **sizes** (`metadata["parse"] = parse_size`): `64MB`, `1.5GiB`, `64M` or plain bytes, see `parse_size`.
- **storage options** (`storage_options_option()`): `-o KEY=VALUE` or `-o '{"KEY": VALUE}'`, repeatable, the same
  on every command, under the names `--storage-option`, `--storage-options` and `-o` (`parse_storage_options`).
- **repeated values**: a `tuple[str, ...]` field that is not positional is an option given once per value.

Commands are made here too (`command_parser`, `add_command`, `add_command_group`, `option_group`), so no
other module builds an argparse parser by hand (tests/test_architecture.py holds it to that).

The core imports no side: it reads the dataclass it is handed and nothing else.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

NONE_WORDS = ("none", "null", "")
# The parsed command line a command's function receives.
Namespace = argparse.Namespace

# Decimal units are powers of 1000 (KB, MB, GB, TB, as disks and object stores count); binary units are
# powers of 1024 (KiB, MiB, GiB, TiB, and the bare letters K, M, G, T, as `ls -h` and `--cache-limit 64G`
# are read by most people).
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_SIZE_FACTORS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
                 "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}
_SIZE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def option(default: Any = dataclasses.MISSING, help: str = "", *, choices: Any = None,
           parse: Callable[[str], Any] | None = None, metavar: str | None = None, flags: tuple[str, ...] = (),
           positional: bool = False, cli_default: str | None = None, cli_type: str | None = None,
           nargs: str | None = None, repr: bool = True, default_factory: Any = dataclasses.MISSING,
           **metadata: Any) -> Any:
    """A configuration field and what its command-line option needs to know.

    Args:
        default: the value when the option is not given (MISSING and no `default_factory`: required).
        help: the option's help text (also the field's documentation).
        choices: the allowed values: a tuple, or a function returning them (imported on use).
        parse: converts the command-line text (sizes, "zstd:9", ...); default: from the field's type.
        metavar: the value's name in `--help`; default: the field's type in capitals.
        flags: command-line names used instead of `--field-name` (e.g. `--format` for `shard_format`); the
            first is the option's name in `--help` and messages. Only short flags (`-o`): added to `--field-name`.
        positional: the field is the command's positional argument (a list when the type is a tuple).
        cli_default: the default as the command line spells it (e.g. "64MB"), for `--help`.
        cli_type: the type the command line reads when the field's own type is not readable (e.g. "str").
        nargs: several values, joined with "," into the field's string.
        repr: include the field in the dataclass repr (False for values that may hold credentials).
        default_factory: as `dataclasses.field`.
        **metadata: anything else the owner records (`order=True`, `records="output"`, ...).
    """
    metadata.update(help=help, choices=choices, parse=parse, metavar=metavar, flags=tuple(flags),
                    positional=positional, cli_default=cli_default, nargs=nargs)
    if cli_type:
        metadata["cli_type"] = cli_type
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata, repr=repr)
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata=metadata, repr=repr)
    return dataclasses.field(default=default, metadata=metadata, repr=repr)


def document_fields(cls: type) -> type:
    """Class decorator: append a Google-style `Attributes:` section, generated from each field's help and
    default, to a configuration dataclass's docstring, so `help(cls)` documents every field as `--help` does."""
    import inspect
    import textwrap

    lines = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("help"):
            default = "" if f.default is dataclasses.MISSING else f" Default: {f.default!r}."
            lines += textwrap.wrap(f"{f.name}: {f.metadata['help']}.{default}", width=100, initial_indent="    ",
                                   subsequent_indent="        ")
    if lines:
        cls.__doc__ = inspect.cleandoc(cls.__doc__ or cls.__name__) + "\n\nAttributes:\n" + "\n".join(lines) + "\n"
    return cls


def option_name(name: str) -> str:
    """`--kebab-case` for a field or option name (`cache_limit` -> `--cache-limit`)."""
    return "--" + name.lstrip("-").replace("_", "-")


def flag(f: dataclasses.Field, name: str | None = None) -> str:
    """The option's name as the command line spells it (its first `--` flag, else `--field-name`)."""
    flags = [text for text in f.metadata.get("flags", ()) if text.startswith("--")]
    return flags[0] if flags else option_name(name or f.name)


def respell(argument: str) -> str:
    """`--a_b[=VALUE]` as `--a-b[=VALUE]` (the snake_case alias); any other argument unchanged."""
    if not argument.startswith("--") or "_" not in argument:
        return argument
    name, equals, value = argument.partition("=")
    return name.replace("_", "-") + equals + value


class OptionParser(argparse.ArgumentParser):
    """An `ArgumentParser` that accepts the snake_case spelling of every option (`--a_b`) as an
    alias of its kebab-case name (`--a-b`). Subcommand parsers inherit the class."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None):  # type: ignore[override]
        import sys

        args = sys.argv[1:] if args is None else list(args)
        if "--" in args:  # after "--" every argument is a value, never an option
            cut = args.index("--")
            args = [respell(a) for a in args[:cut]] + args[cut:]
        else:
            args = [respell(a) for a in args]
        return super().parse_known_args(args, namespace)


class OptionValueError(argparse.ArgumentTypeError, ValueError):
    """A value an option cannot take: argparse reports its message as is, and callers outside the command
    line (a search space, a config file) catch it as the `ValueError` it also is."""


def parse_bool(text: str | bool) -> bool:
    """True for 1/true/yes/on, False for 0/false/no/off (any case).

    Raises:
        OptionValueError: any other text.
    """
    if isinstance(text, bool):
        return text
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise OptionValueError(f"expected true or false, got {text!r}")


def parse_size(text: str | int, *, option: str = "size") -> int:
    """Bytes in a size: "64MB" (decimal: KB, MB, GB, TB are powers of 1000), "1.5GiB" or "64M" (binary: KiB,
    MiB, GiB, TiB and the bare K, M, G, T are powers of 1024), or plain bytes ("1000000"); any case.

    Raises:
        ValueError: text that is not a size, or a size under 1 byte, naming `option`.
    """
    if isinstance(text, bool):
        raise ValueError(f"{option}: expected a size, got {text!r}")
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE.match(str(text))
        if not match or match.group(2).lower() not in _SIZE_FACTORS:
            raise ValueError(f"{option}: cannot read {text!r} as a size (examples: 64MB, 1.5GiB, 64M, 1000000)")
        value = int(float(match.group(1)) * _SIZE_FACTORS[match.group(2).lower()])
    if value < 1:
        raise ValueError(f"{option} must be at least 1 byte, got {text!r}")
    return value


def format_size(n: float, *, exact: bool = False) -> str:
    """A byte count for people, in binary units: "812 B", "1.5 MiB"; `exact` adds the bytes: "1.5 MiB (1,572,864 B)"."""
    value, unit = float(n), "B"
    for unit in _SIZE_UNITS:
        if abs(value) < 1024 or unit == _SIZE_UNITS[-1]:
            break
        value /= 1024
    if unit == "B":
        return f"{n:,.0f} B"
    text = f"{value:,.1f} {unit}"
    return f"{text} ({n:,.0f} B)" if exact else text


STORAGE_OPTIONS_HELP = (
    "fsspec storage option for the dataset's filesystem: KEY=VALUE (VALUE is read as JSON when it can be: quote a "
    "string that looks like a number, key='\"123\"') or a JSON object of several; repeatable, e.g. "
    "-o endpoint_url=http://127.0.0.1:9000 -o client_kwargs='{\"region_name\": \"us-east-1\"}'. Values may hold "
    "credentials: never printed nor saved")


def parse_storage_options(value: Any, *, option: str = "--storage-options") -> dict[str, Any]:
    """fsspec storage options from any of the forms the commands accept: None, a dict, one text, or several
    texts (a repeated option); each text is a JSON object or `KEY=VALUE` (VALUE as JSON where it parses, else
    the text). Later texts override earlier keys.

    Raises:
        ValueError: a text that is neither, naming `option` and the text's position but never its content
            (it may hold a credential).
    """
    if value is None:
        return {}
    if isinstance(value, dict):
        return dict(value)
    items = [value] if isinstance(value, str) else list(value)
    options: dict[str, Any] = {}
    for position, item in enumerate(items, start=1):
        if not isinstance(item, str):
            raise ValueError(f"{option} value number {position} is a {type(item).__name__}, not text")
        where = f"{option} value number {position}" if len(items) > 1 else f"{option}"
        if item.lstrip().startswith("{"):
            try:
                parsed = json.loads(item)
            except json.JSONDecodeError:
                parsed = None
            if not isinstance(parsed, dict):
                raise ValueError(f"{where} is not a JSON object (its text is not shown: it may hold a credential)")
            options.update(parsed)
            continue
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"{where} is neither KEY=VALUE nor a JSON object (its text is not shown: it may hold "
                             "a credential)")
        try:
            options[key] = json.loads(text)
        except json.JSONDecodeError:
            options[key] = text
    return options


def merge_storage_options(previous: str | None, text: str) -> str:
    """The storage options given so far (JSON text) with one more `-o` value folded in, as JSON text."""
    merged = {**parse_storage_options(previous), **parse_storage_options(text, option="the value")}
    return json.dumps(merged, sort_keys=True)


def storage_options_option(help: str = STORAGE_OPTIONS_HELP, **metadata: Any) -> Any:
    """The storage-options field every command shares: `--storage-option`, `--storage-options` and `-o`,
    repeatable, each value `KEY=VALUE` or a JSON object; the field holds them merged as one JSON object's
    text (`parse_storage_options` reads it), which never enters a repr. `metadata`: what its owner records."""
    return option(None, help, flags=("--storage-option", "--storage-options", "-o"), metavar="KEY=VALUE|JSON",
                  merge=merge_storage_options, cli_type="str | None", repr=False, **metadata)


class _Merge(argparse.Action):
    """Each occurrence of the option folds its value into those before it (`combine(previous, text)`)."""

    def __init__(self, *args: Any, combine: Callable[[Any, str], Any], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.combine = combine

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        try:
            setattr(namespace, self.dest, self.combine(getattr(namespace, self.dest, None), values))
        except ValueError as err:
            raise argparse.ArgumentError(self, str(err)) from None


class _Choices:
    """Allowed values read from the implementing module's registry on first use, so registering a command
    imports nothing heavy (argparse only iterates them to check a value or print help)."""

    def __init__(self, names: Callable[[], Iterable[str]]) -> None:
        self._names = names

    def __contains__(self, value: object) -> bool:
        return value in tuple(self._names())

    def __iter__(self):
        return iter(tuple(self._names()))


def _type_text(f: dataclasses.Field) -> str:
    return f.metadata.get("cli_type") or str(f.type)


def field_converter(f: dataclasses.Field, name: str | None = None) -> Callable[[str], Any]:
    """The `type=` of a field's option: its `parse`, else a parser for its annotation (int, float, str, bool,
    optional: "none" gives None). A `ValueError` becomes argparse's message naming the option."""
    type_text = _type_text(f)
    optional = "None" in type_text
    base = type_text.replace("| None", "").strip()
    custom = f.metadata.get("parse")
    parse = custom or {"int": int, "float": float, "str": str, "bool": parse_bool}[base]
    option_text = flag(f, name)

    def convert(text: str) -> Any:
        if optional and text.strip().lower() in NONE_WORDS:
            return None
        try:
            return parse(text)
        except ValueError as err:  # argparse would print only "invalid value": keep the reason
            if custom is None:
                raise argparse.ArgumentTypeError(f"expected {base}, got {text!r}") from None
            message = str(err)
            if message.startswith(option_text):
                message = message[len(option_text):].lstrip(": ")
            raise argparse.ArgumentTypeError(message or f"expected {base}, got {text!r}") from None

    convert.__name__ = getattr(parse, "__name__", base)  # argparse names the type in its error message
    return convert


def add_field_option(target: Any, f: dataclasses.Field, *, name: str | None = None, section: str | None = None,
                     default_text: Any = dataclasses.MISSING, bool_values: bool = True) -> None:
    """Add the option of one configuration field to a parser or argument group.

    Args:
        target: an `argparse.ArgumentParser` or argument group.
        f: the field; its metadata is what `option` records.
        name: the option's name when it differs from the field's (a renamed field); the destination is
            `name` (or `SECTION.name`).
        section: also accept `--SECTION.NAME` (and make the destination `SECTION.NAME`).
        default_text: the default as `--help` states it (default: `cli_default`, else the field's default).
        bool_values: a boolean is `--NAME [BOOL]`; False: a plain flag (for commands with positional lists).
    """
    meta, name = f.metadata, name or f.name
    dest = f"{section}.{name}" if section else name
    if default_text is dataclasses.MISSING:
        default_text = meta.get("cli_default") or (f.default if f.default is not dataclasses.MISSING else None)
    required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    help_text = meta.get("help", "") + ("" if required else f" (default: {default_text})")
    if meta.get("positional"):
        target.add_argument(dest, nargs="+" if str(f.type).startswith("tuple") else None,
                            metavar=meta.get("metavar"), help=help_text.replace("%", "%%"))
        return
    flags = list(meta.get("flags", ()))
    names = flags if any(text.startswith("--") for text in flags) else [option_name(name), *flags]
    if section:
        names.append(f"{option_name(section)}.{option_name(name)[2:]}")
    kwargs: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS, "help": help_text.replace("%", "%%")}
    if _type_text(f) == "bool":
        negative = f"--no-{option_name(name)[2:]}"
        negative_help = argparse.SUPPRESS
        if bool_values:
            kwargs.update(nargs="?", const=True, metavar="BOOL", type=parse_bool)
        else:
            kwargs.update(action="store_true")
            if f.default is True:  # a flag that is on by default: only its negative is worth showing
                negative_help, kwargs["help"] = f"do not {meta.get('help', '')}".replace("%", "%%"), argparse.SUPPRESS
        target.add_argument(*names, **kwargs)
        target.add_argument(negative, dest=dest, action="store_false", default=argparse.SUPPRESS, help=negative_help)
        return
    if meta.get("merge"):  # repeated, each value folded into the ones before
        kwargs.update(action=_Merge, combine=meta["merge"], metavar=meta.get("metavar"))
    elif str(f.type).startswith(("dict", "tuple")):  # KEY=VALUE pairs or values, repeated
        kwargs.update(action="append", metavar=meta.get("metavar"))
    else:
        kwargs.update(type=field_converter(f, name), required=required,
                      metavar=meta.get("metavar") or _type_text(f).replace(" | None", "").upper())
        choices = meta.get("choices")
        if choices:
            kwargs["choices"] = _Choices(choices) if callable(choices) else choices
            if callable(choices):
                kwargs["help"] += " (one of: %(choices)s)"
        if meta.get("nargs"):
            kwargs["nargs"] = meta["nargs"]
    target.add_argument(*names, **kwargs)


def add_dataclass_options(target: Any, cls: type, *, bool_values: bool = True,
                          skip: Iterable[str] = ()) -> None:
    """Add one option per field of configuration dataclass `cls` (see `add_field_option`), in field order."""
    for f in dataclasses.fields(cls):
        if f.name not in skip:
            add_field_option(target, f, bool_values=bool_values)


def given_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of `cls` given on the command line (options not given keep the dataclass defaults)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}


def command_parser(*, version: str | None = None, options: Iterable[type] = (), bool_values: bool = True,
                   **kwargs: Any) -> OptionParser:
    """A program's top-level parser (`shardkit`, `python -m shardkit.train`, `python -m shardkit.metrics`).

    Args:
        version: what `--version` prints (no `--version` without it).
        options, bool_values: dataclasses whose fields are its options, as in `add_command`.
        **kwargs: `prog`, `usage`, `description`, `epilog`, as `ArgumentParser` takes them.
    """
    parser = OptionParser(**kwargs)
    if version:
        parser.add_argument("--version", action="version", version=version)
    for cls in options:
        add_dataclass_options(parser, cls, bool_values=bool_values)
    return parser


def add_subcommands(parser: argparse.ArgumentParser, *, dest: str = "command", metavar: str = "COMMAND") -> Any:
    """The subparsers of `parser`, for `add_command` and `add_command_group`."""
    return parser.add_subparsers(dest=dest, metavar=metavar)


def add_command_group(subparsers: Any, name: str, *, help: str, description: str = "") -> Any:
    """A command whose actions are subcommands (`shardkit tokenizer train`): its subparsers. Alone, the
    command prints its help and exits 2."""
    parser = subparsers.add_parser(name, help=help, description=description or help)
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])
    return add_subcommands(parser, dest=f"{name}_command", metavar="ACTION")


def add_command(subparsers: Any, name: str, func: Callable[[Namespace], int], *, help: str, description: str,
                options: Iterable[type] = (), epilog: str | None = None, usage: str | None = None,
                bool_values: bool = True, allow_abbrev: bool = True) -> OptionParser:
    """Add command `name`, whose options are the fields of the dataclasses `options`, that runs `func(args)`.

    Args:
        subparsers: what `command_parser(...).add_subparsers()` (or `add_command_group`) returned.
        func: runs the command; `given_values(args, cls)` gives each dataclass's fields given.
        help, description, usage, epilog: as `--help` shows them.
        bool_values: see `add_field_option` (False for commands with positional arguments).
        allow_abbrev: False where one option's name starts another's (`--storage`, `--storage-options`).
    """
    # An epilog of several lines (examples) keeps its line breaks, and then so does the description.
    formatter = argparse.RawDescriptionHelpFormatter if epilog and "\n" in epilog else argparse.HelpFormatter
    parser = subparsers.add_parser(name, help=help, description=description, epilog=epilog, usage=usage,
                                   allow_abbrev=allow_abbrev, formatter_class=formatter)
    for cls in options:
        add_dataclass_options(parser, cls, bool_values=bool_values)
    parser.set_defaults(func=func)
    return parser


def option_group(parser: Any, title: str, description: str | None = None) -> Any:
    """A titled group of options in `--help` (add options to it with `add_dataclass_options`)."""
    return parser.add_argument_group(title, description)
