"""`shardkit convert`: tokenized datasets in other formats -> shardkit shards, without re-tokenizing.

A source format is an input side of the build's pipeline (`shardkit.tools.build.run_pipeline`): it
expands SRC into files, cuts them into work units in the parent, and a worker turns a unit into
documents of token ids (`documents.token_documents`), where `shardkit build` would tokenize text.
Packing, shard writing, the manifest, the resume checkpoint, the accounting (in = written + rejected),
the report and `--workers` / `--executor ray` are the build's own.

`SOURCE_FORMATS` names the formats `--from` accepts; each is one module here.
"""

from __future__ import annotations

from typing import Any

# The formats `--from` accepts, each one module of this package. Kept import-light: the CLI reads it.
SOURCE_FORMATS = ("megatron", "hf", "mds", "litdata")
__all__ = ["SOURCE_FORMATS", "ConvertConfig", "run_convert"]


def __getattr__(name: str) -> Any:
    # `shardkit --help` imports this package for SOURCE_FORMATS; the pipeline loads only when used.
    if name == "run_convert":
        from .run import run_convert
        return run_convert
    if name == "ConvertConfig":
        from .config import ConvertConfig
        return ConvertConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
