"""`ConvertConfig` and `ExportConfig`: what `shardkit convert` and `shardkit export` are told.

Options that mean what they mean for `shardkit build` (output, shard format and size, compression,
packing, workers, executor, on-error, resume unit, ...) are `BuildConfig`'s own fields, taken over
with their help, parsing and record markings (`same_as_build`), so both commands spell and check them
alike and the CLI generator makes them the same way. Only the input side is new.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..config import ON_ERROR_MODES, fields as build_fields, flag, option, registry

EXPORT_UNITS = ("document", "sample")
EXPORT_FORMATS = ("megatron",)
__all__ = ["ConvertConfig", "ExportConfig", "EXPORT_FORMATS", "EXPORT_UNITS", "ON_ERROR_MODES", "same_as_build"]


def same_as_build(name: str, **changes: Any) -> Any:
    """A field that is `BuildConfig`'s field `name` (default, help, parsing, flags, record marking), with
    `changes` to its metadata (e.g. another default)."""
    original = build_fields()[name]
    metadata = {**original.metadata, **changes}
    default = metadata.pop("default", original.default)
    return option(default, repr=original.repr, **metadata)


def check_fields(config: Any, *, minimums: dict[str, int]) -> None:
    """Every choice within its registry, every named field at least its minimum (errors name the option)."""
    for f in dataclasses.fields(config):
        allowed = f.metadata["choices"]() if f.metadata.get("choices") else None
        if allowed is not None and getattr(config, f.name) not in allowed:
            raise ValueError(f"{flag(f)} must be one of {', '.join(allowed)}, got {getattr(config, f.name)!r}")
        least = minimums.get(f.name)
        if least is not None and getattr(config, f.name) is not None and getattr(config, f.name) < least:
            raise ValueError(f"{flag(f)} must be >= {least}, got {getattr(config, f.name)}")


@dataclass(frozen=True, kw_only=True)
class ConvertConfig:
    """Everything `shardkit convert` is told (one field per command-line option)."""

    inputs: tuple[str, ...] = option(
        help="the source dataset(s), in order: a Megatron prefix (PATH for PATH.bin + PATH.idx; a directory: "
             "every .idx in it), a Hugging Face `save_to_disk` directory (one split) or Parquet files, "
             "directories or globs, an MDS or LitData directory (holding index.json); local paths or fsspec URLs",
        records="output", positional=True, metavar="SRC")
    source_format: str = option(
        help="the source's format: 'megatron' (indexed dataset .bin/.idx), 'hf' (datasets save_to_disk or Parquet "
             "with a token-id column), 'mds' (MosaicML Streaming shards with a token-id ndarray column), 'litdata' "
             "(LitData chunks written with TokensLoader, one document an item)",
        records="output",
        choices=registry("shardkit.tools.convert", "SOURCE_FORMATS"), flags=("--from",), metavar="FORMAT")
    output: str = same_as_build("output")
    tokenizer: str | None = option(
        None, "the tokenizer the ids come from (same specs as `shardkit build --tokenizer`); default: the identity "
              "recorded in the source's metadata (PREFIX.shardkit.json, written by `shardkit export`); refused when "
              "neither names one", records="output", metavar="SPEC")
    token_field: str = option("input_ids", "with --from hf or mds: the column of token ids (a list of integers per "
                                           "row, an integer ndarray per MDS sample)",
                              records="output", metavar="NAME")
    seq_len: int = same_as_build("seq_len")
    shard_format: str = same_as_build("shard_format")
    packing: str = same_as_build("packing")
    shard_size: int = same_as_build("shard_size")
    compression_level: int = same_as_build("compression_level")
    on_error: str = same_as_build(
        "on_error", help="bad input (a truncated .bin, .idx offsets past the data, token ids beyond the vocabulary, "
                         "null or empty rows, unreadable files): 'skip' counts it and lists examples in the report; "
                         "'fail' stops with the file and record and exits non-zero")
    bestfit_buffer: int = same_as_build("bestfit_buffer")
    bestfit_open: int = same_as_build("bestfit_open")
    workers: int | None = same_as_build("workers", help="parallel readers: threads for megatron, hf and litdata "
                                                        "sources (their reads and checks release the GIL), processes "
                                                        "for mds (or Ray tasks in flight); default: the cores "
                                                        "available. The output does not depend on it")
    encode_threads: int | None = same_as_build("encode_threads")
    executor: str = same_as_build("executor")
    ray_address: str | None = same_as_build("ray_address")
    overwrite: bool = same_as_build("overwrite")
    unit_bytes: int = same_as_build("unit_bytes", help="source bytes per work unit handed to a worker (resumption "
                                                       "restarts at most one unit)")
    max_examples: int = same_as_build("max_examples")
    progress: bool = same_as_build("progress")
    storage_options: dict[str, Any] | None = same_as_build("storage_options")

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        if not self.inputs:
            raise ValueError("give at least one SRC")
        if not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise ValueError(f"--seq-len must be a positive integer, got {self.seq_len!r}")
        if not 1 <= self.compression_level <= 22:
            raise ValueError(f"--compression level must be in 1-22, got {self.compression_level}")
        check_fields(self, minimums={"workers": 1, "encode_threads": 0, "shard_size": 1, "bestfit_buffer": 1, "bestfit_open": 0,
                                     "unit_bytes": 1})


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    """Everything `shardkit export` is told (one field per command-line option)."""

    dataset: str = option(help="the shardkit dataset to export (its prefix: a directory or fsspec URL)",
                          positional=True, metavar="DATASET")
    target_format: str = option(help="the format to write: 'megatron' (an indexed dataset PREFIX.bin + PREFIX.idx "
                                     "that megatron-core's IndexedDataset opens)",
                                choices=registry(__name__, "EXPORT_FORMATS"), flags=("--to",), metavar="FORMAT")
    output: str = option(help="the prefix to write: PREFIX.bin, PREFIX.idx and PREFIX.shardkit.json (the tokenizer "
                              "identity and the dataset it came from)", metavar="PREFIX")
    unit: str = option("document", "what one Megatron document is: 'document' (the source documents, rebuilt from "
                                   "the samples' document segments without padding; needs document boundaries) or "
                                   "'sample' (each sample as stored, padding included)",
                       choices=registry(__name__, "EXPORT_UNITS"), metavar="UNIT")
    overwrite: bool = option(False, "replace PREFIX.bin / PREFIX.idx when they exist (otherwise refused)")
    progress: bool = same_as_build("progress")
    storage_options: dict[str, Any] | None = same_as_build("storage_options")

    def __post_init__(self) -> None:
        check_fields(self, minimums={})
