"""`BuildConfig`: everything `shardkit build` is told, one frozen field per command-line option.

Each field carries its CLI help in `metadata` (`shardkit.cli.build` generates the options from the
fields, as `shardkit.train.options` does for the trainer) and says how it relates to the output:

- `records="output"`: the value decides the bytes of the shards; it is recorded in the manifest's
  `build` dict and its hash is the build fingerprint (`build_record`), so changing it makes a rerun
  refuse to resume or to call the output done;
- `records="resume"`: it changes no byte of the output but a checkpoint written under another
  value cannot be resumed (the work-unit size decides where a resumed build restarts);
- unmarked: how the build runs (workers, executor, progress bar, ...), never recorded.

The fields that decide how text becomes samples (tokenizer, seq_len, packing, text field, txt mode, special
ids, document limit, bestfit's parameters) are `shardkit.text.recipe.TextRecipe`'s, taken over with their help,
defaults, parsing and checks (`recipe_option`, `check_recipe`), so the build and the raw-text loader spell and
check them alike; `config.recipe` is the build's recipe. The one field the build names otherwise is `packing`
(the name its record and its manifests carry, so fingerprints stay): `--pack`, `pack=` and `config.pack` are
accepted too.

Allowed values come from the registries of the code that implements them (`PACKING_MODES`,
`SHARD_FORMATS`, `TXT_MODES`, `EXECUTORS`), loaded only when needed so `shardkit --help` and
`shardkit inspect` stay light.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

from shardkit.options import flag, option_name, parse_size, storage_options_option
from shardkit.options import option as cli_option
from shardkit.text.recipe import TextRecipe, check_recipe, recipe_fields, recipe_option, registry

ON_ERROR_MODES = ("skip", "fail")


def parse_compression(text: str) -> int:
    """zstd level from "zstd" (level 3) or "zstd:LEVEL" (1-22)."""
    codec, _, level = text.partition(":")
    if codec != "zstd":
        raise ValueError(f"--compression: only zstd is supported, got {text!r} (examples: zstd, zstd:9)")
    try:
        value = int(level) if level else 3
    except ValueError:
        raise ValueError(f"--compression: level must be an integer, got {level!r}") from None
    if not 1 <= value <= 22:
        raise ValueError(f"--compression: zstd level must be in 1-22, got {value}")
    return value


def option(default: Any = dataclasses.MISSING, help: str = "", *, records: str | None = None,
           when: Callable[[Any], bool] | None = None, **cli: Any) -> Any:
    """A `BuildConfig` field: its command-line option (`shardkit.options.option`'s arguments) and what the
    fingerprint needs to know about it.

    Args:
        default: the value when the option is not given (MISSING: required).
        help: the option's help text.
        records: "output" (decides the output's bytes), "resume" (decides where a resume restarts) or None.
        when: a recorded field is recorded only when `when(config)` holds (bestfit's settings).
        **cli: `choices`, `flags`, `parse`, `metavar`, `positional`, `cli_default`, `repr` (see
            `shardkit.options.option`).
    """
    return cli_option(default, help, records=records, when=when, **cli)


def _with_bestfit(config: Any) -> bool:
    return config.packing == "bestfit"


def _also_spelled(**aliases: str) -> Callable[[type], type]:
    """Class decorator: accept each alias as a keyword for the field it names (`pack=` for `packing`). Given with
    the field's own name too, the alias wins: `dataclasses.replace(config, pack=...)` passes both."""

    def decorate(cls: type) -> type:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, **values: Any) -> None:
            for alias, name in aliases.items():
                if alias in values:
                    values[name] = values.pop(alias)
            init(self, **values)

        cls.__init__ = __init__
        return cls

    return decorate


@_also_spelled(pack="packing")
@dataclass(frozen=True, kw_only=True)
class BuildConfig:
    """Everything `shardkit build` is told (one field per command-line option)."""

    inputs: tuple[str, ...] = option(
        help="files, directories (searched recursively), globs or fsspec URLs (s3://...). Recognised by name: "
             ".jsonl, .jsonl.gz, .jsonl.zst (one JSON object per line), .parquet, .txt. Example: 'corpus/*.jsonl.zst'",
        records="output", positional=True, metavar="INPUT")
    output: str = option(help="dataset prefix to write: a local directory or any fsspec URL, e.g. "
                              "s3://bucket/datasets/web", metavar="URL")
    tokenizer: str = recipe_option("tokenizer", records="output")
    seq_len: int = recipe_option("seq_len", records="output")
    shard_format: str = option(
        "arrow", "shard format: 'arrow' (Arrow IPC with zstd buffers: compact, ~1.5x smaller than raw tokens, "
        "fastest to decode) or 'tar' (zstd .npy members, one group per block of samples, within a few percent "
        "of arrow's size; readable by webdataset and tar, see docs/FORMAT.md section 4)",
        records="output", choices=registry("shardkit.manifest", "SHARD_FORMATS"), flags=("--format",), metavar="FORMAT")
    # The recipe's `pack`, named as the build record and manifests name it (its fingerprint keeps that name).
    packing: str = recipe_option("pack", records="output", flags=("--pack", "--packing"))
    shard_size: int = option(
        64 * 10**6, "uncompressed payload per shard: 64MB (decimal KB/MB/GB), 256MiB (binary KiB/MiB/GiB) or bytes",
        records="output", parse=lambda text: parse_size(text, option="--shard-size"), metavar="SIZE",
        cli_default="64MB")
    compression_level: int = option(
        3, "shard compression: zstd with an optional level 1-22, e.g. zstd:9", records="output",
        parse=parse_compression, flags=("--compression",), metavar="zstd[:LEVEL]", cli_default="zstd (level 3)")
    text_field: str = recipe_option("text_field", records="output")
    txt_mode: str = recipe_option("txt_mode", records="output")
    on_error: str = option(
        "skip", "bad input (malformed JSON, missing or non-string text, invalid UTF-8, empty or enormous documents, "
        "unreadable or truncated files): 'skip' counts it and lists examples in the report and summary; 'fail' "
        "stops with the file and line and exits non-zero", choices=registry(__name__, "ON_ERROR_MODES"), metavar="MODE")
    eos_id: int | str | None = recipe_option("eos_id", records="output")
    bos_id: int | str | None = recipe_option("bos_id", records="output")
    max_doc_chars: int = recipe_option("max_doc_chars", records="output")
    bestfit_buffer: int = recipe_option("bestfit_buffer", records="output", when=_with_bestfit)
    bestfit_open: int = recipe_option("bestfit_open", records="output", when=_with_bestfit)
    workers: int | None = option(None, "parallel tokenizer processes (or Ray tasks in flight); default: the cores "
                                       "available to this process. The output does not depend on it", metavar="N")
    encode_threads: int | None = option(
        None, "shards compressed, hashed and stored at once in background threads while the next ones are packed "
              "(0: in the main thread); default: one per core available, as many as half the available memory holds "
              "at 3x --shard-size each. The output does not depend on it", metavar="N")
    executor: str = option("local", "'local': worker processes on this machine; 'ray': Ray tasks (see "
                                    "--ray-address). Same output either way",
                           choices=registry("shardkit.tools.executors", "EXECUTORS"), metavar="KIND")
    ray_address: str | None = option(None, "Ray cluster to run on with --executor ray, e.g. 'auto' or "
                                           "ray://head:10001; default: start a local Ray instance with --workers CPUs",
                                     metavar="ADDRESS")
    overwrite: bool = option(False, "replace another build's shards, manifest and state in --output (otherwise "
                                    "refused). Rerunning the same command never needs it: it resumes or does nothing")
    unit_bytes: int = option(1 << 20, "input bytes per work unit handed to a worker (resumption restarts at most "
                                      "one unit)", records="resume", parse=lambda text: parse_size(text, option="--unit-size"),
                             flags=("--unit-size",), metavar="SIZE", cli_default="1MiB")
    max_examples: int = option(20, "rejected documents listed by file and line in the report",
                               flags=("--report-examples",), metavar="N")
    progress: bool = option(True, "show the progress bar")
    storage_options: dict[str, Any] | None = storage_options_option(
        "fsspec options for the inputs' and the output's filesystems: KEY=VALUE (e.g. -o endpoint_url=http://host:9000) "
        "or a JSON object; repeat for several (values are never logged)", records=None, when=None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        if not self.inputs:
            raise ValueError("give at least one INPUT")
        check_recipe(self._recipe_values(), name=option_name)
        for f in dataclasses.fields(self):
            allowed = f.metadata["choices"]() if f.metadata.get("choices") else None
            if allowed is not None and getattr(self, f.name) not in allowed:
                raise ValueError(f"{flag(f)} must be one of {', '.join(allowed)}, got {getattr(self, f.name)!r}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.encode_threads is not None and self.encode_threads < 0:
            raise ValueError(f"--encode-threads must be >= 0, got {self.encode_threads}")
        if not 1 <= self.compression_level <= 22:
            raise ValueError(f"--compression level must be in 1-22, got {self.compression_level}")
        for name in ("shard_size", "unit_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag(fields()[name])} must be >= 1, got {getattr(self, name)}")

    @property
    def pack(self) -> str:
        """`packing` as the recipe spells it."""
        return self.packing

    @property
    def recipe(self) -> TextRecipe:
        """How this build turns text into samples (the settings a raw-text loader shares with it)."""
        return TextRecipe(**self._recipe_values())

    def _recipe_values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in recipe_fields()}


def fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(BuildConfig)}


def recorded_fields(config: BuildConfig, kind: str) -> list[str]:
    """Names of the fields marked `records=kind` that apply to `config`."""
    names = []
    for f in dataclasses.fields(config):
        when = f.metadata.get("when")
        if f.metadata.get("records") == kind and (when is None or when(config)):
            names.append(f.name)
    return names


def build_record(config: BuildConfig, resolved: dict[str, Any]) -> dict[str, Any]:
    """The configuration that decides the output: every `records="output"` field, with the values the
    build resolved in place of what was asked (`resolved`: inputs as files with their content hashes,
    "auto" special ids as ids). Recorded in the manifest; its hash is the build fingerprint."""
    record: dict[str, Any] = {"tool": "shardkit build"}
    for name in recorded_fields(config, "output"):
        record[name] = resolved[name] if name in resolved else getattr(config, name)
    return record


def resume_key(config: BuildConfig) -> str:
    """What must match, besides the fingerprint, for a checkpoint to be resumed (`records="resume"` fields)."""
    return ",".join(f"{name}={getattr(config, name)}" for name in recorded_fields(config, "resume"))
