"""Which source a `StreamingDataset` gets: of built data (`built_source`) one dataset (`BuiltSource`) or a mixture
(`mixture.MixtureSource`); with `tokenizer=` (`raw_text_source`) one corpus (`RawTextSource`) or a mixture of
`Stream`s (`MixtureSource`); and the loader options raw text refuses, each with why and what to use instead."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from shardkit.manifest import MANIFEST_NAME

from ..config import LoaderConfig
from ..order.mixing import Stream
from .built.streams import holds_manifest
from .built.source import BuiltSource
from .built.streams import Sources
from .mixture import MixtureSource
from .raw.corpus import RawTextSettings
from .raw.source import RawTextSource
from .raw.unreadable import check_policy


# The `LoaderConfig` fields raw text reads (the others keep their defaults, see `check_raw_options`).
RAW_OPTIONS = frozenset({"seed", "shuffle", "token_dtype", "segment_ids", "on_corrupt", "skip_samples",
                         "quarantine_list"})
# ... and those a mixture's built streams read.
CACHE_OPTIONS = frozenset({"cache_limit", "cache_wait", "prefetch", "cache_mode", "chunk_samples"})
# Why an option means nothing to raw text, and what to use instead.
_WHY_NOT_RAW = {
    **dict.fromkeys(("num_partitions", "block_size", "shuffle_window", "partial_batches", "epoch_size"),
                    "raw text's order is its lanes (each shuffles its units per lane epoch, endlessly): set lanes= "
                    "and seed= instead"),
    **dict.fromkeys(("max_tokens", "token_window"), "token-budget batches need built data; raw text's batches hold "
                    "batch_size samples (pack='none' keeps documents whole)"),
    **dict.fromkeys(CACHE_OPTIONS, "raw text is read from its inputs, not through the node cache (it applies to "
                    "built datasets and to built streams mixed with raw text)"),
}


def check_raw_options(config: LoaderConfig, *, mixture: bool) -> None:
    """Refuse a loader option that raw text cannot honour (one that keeps its default is not asked about).

    Raises:
        ValueError: naming the option, why it has no meaning here, and what to use instead.
    """
    check_policy(config.on_corrupt, config.skip_samples, config.quarantine_list)
    allowed = RAW_OPTIONS | (CACHE_OPTIONS if mixture else frozenset())
    default = LoaderConfig()
    for option in (f.name for f in fields(LoaderConfig)):
        if option not in allowed and getattr(config, option) != getattr(default, option):
            raise ValueError(f"{option}={getattr(config, option)!r} has no meaning for raw text: "
                             f"{_WHY_NOT_RAW.get(option, 'drop it')}")


def built_source(config: LoaderConfig, streams: list[Stream], sources: Sources, **options: Any) -> Any:
    """The source of `StreamingDataset(source)` without `tokenizer=`: one dataset, or a mixture of several
    (`options`: topology_args, group_args)."""
    if len(streams) == 1:
        return BuiltSource(config, streams[0], sources, **options)
    return MixtureSource.of_built(config, streams, sources, **options)


def raw_text_source(source: Any, settings: RawTextSettings, config: LoaderConfig, **options: Any) -> Any:
    """The source of `StreamingDataset(source, tokenizer=...)`: a mixture for a list of `Stream`, else one corpus.

    Raises:
        TypeError: a list that mixes `Stream`s with plain inputs.
        ValueError: a loader option raw text cannot honour (`check_raw_options`).
    """
    items = [source] if isinstance(source, (str, Stream)) else list(source) if isinstance(source, (list, tuple)) \
        else None
    mixture = items is not None and any(isinstance(item, Stream) for item in items)
    check_raw_options(config, mixture=mixture)
    if mixture:
        if not all(isinstance(item, Stream) for item in items):
            raise TypeError("a raw-text source is either inputs (paths, globs, URLs) or a list of Stream, not both: "
                            "give each input as Stream(url, weight, raw_text=True)")
        return MixtureSource.with_raw_text(items, settings, config, **options)
    if options.pop("cache_dir", None) is not None:
        raise ValueError("cache_dir: raw text is read from its inputs, not through the node cache; drop cache_dir "
                         "(it applies to built datasets and to built streams mixed with raw text)")
    check_not_built(items or [], options.get("storage_options"))
    return RawTextSource(source, settings, config, **options)


def check_not_built(inputs: list[Any], storage_options: dict[str, Any] | None) -> None:
    """Refuse a built dataset given as raw text (`StreamingDataset(built_url, tokenizer=...)`).

    Raises:
        ValueError: naming the dataset and the two ways to read it.
    """
    for url in inputs:
        if isinstance(url, str) and holds_manifest(url, storage_options):
            raise ValueError(f"{url} is a built dataset (it holds {MANIFEST_NAME}), and tokenizer= is for raw text: "
                             "drop tokenizer= and seq_len= to read it as built data (its manifest names its "
                             f"tokenizer), or mix it with raw text as Stream({url!r}, weight) among raw_text=True "
                             "streams")
