"""The datasets a `StreamingDataset` reads: each stream's storage, manifest and node-local cache, opened once.

`open_sources` resolves the `source` argument into streams, fetches their manifests through the node
cache, checks that they can be read together (mixture compatibility, and the options that depend on
the data: `check_options_fit`), and builds the shard cache of each stream. The result answers the
questions about shards that the loader's other parts ask (which stream owns a shard, its URL, whether it
is corrupt), so none of them needs the dataset.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from glob import has_magic
from typing import Any

from shardkit.errors import CorruptShardError
from shardkit.formats.sample import numpy_token_dtype
from shardkit.manifest import MANIFEST_NAME, Manifest
from shardkit.node_cache import fetch_manifest
from shardkit.storage import Storage

from ...order.shard_table import ShardTable
from ...cache.shard_cache import ShardCache, keeps_node_files
from ...config import LoaderConfig
from ...order.mixing import Stream
from .reading import ShardOwners
from ...order.schedule import Schedule


class Sources:
    """The streams of a dataset (one, or a mixture), with their storage, manifest and shard cache.

    Args:
        streams: the streams (see `streams_of`).
        config: the loader options (cache mode, limit and wait).
        cache_dir: node-local cache directory (None: the default).
        storage_options: fsspec options of streams that have none of their own.

    Raises:
        ValueError: manifests that cannot be mixed, or an option that does not fit the data.
    """

    def __init__(self, streams: Sequence[Stream], config: LoaderConfig, *, cache_dir: str | None,
                 storage_options: dict[str, Any] | None):
        self.streams = list(streams)
        self.storages = [Storage(s.url, s.storage_options if s.storage_options is not None else storage_options)
                         for s in self.streams]
        # A cache that keeps nothing on disk keeps no manifest copy either: every process reads it.
        node_copy = keeps_node_files(config.cache_mode)
        self.manifests: list[Manifest] = [fetch_manifest(st, cache_dir, node_copy=node_copy)
                                          for st in self.storages]
        check_mixable(self.streams, self.manifests)
        check_options_fit(config, self.streams, self.manifests)
        self.caches = [ShardCache(st, m, cache_dir, cache_limit=config.cache_limit, wait_timeout=config.cache_wait,
                                  cache_mode=config.cache_mode)
                       for st, m in zip(self.storages, self.manifests)]
        self._number_shards()

    def _number_shards(self) -> None:
        """Number the streams' shards in stream order (one shard table over them all)."""
        self.owners = ShardOwners([len(m.shards) for m in self.manifests])
        self.shard_sizes = [m.columns.samples for m in self.manifests]
        self.table = ShardTable.of_streams(self.shard_sizes)

    def of_stream(self, index: int) -> Sources:
        """Stream `index` alone (a mixture's child): its storage, manifest and cache, shared with these."""
        view = Sources.__new__(Sources)
        view.streams, view.storages = [self.streams[index]], [self.storages[index]]
        view.manifests, view.caches = [self.manifests[index]], [self.caches[index]]
        view._number_shards()
        return view

    def describe_shard(self, index: int) -> tuple[str, int, str]:
        """(URL, samples, its stream's URL) of shard `index` over all streams (for logs and metrics)."""
        stream, local = self.owners[index]
        shard = self.manifests[stream].shards[local]
        return self.storages[stream].url_of(shard.name), shard.samples, self.streams[stream].url

    def verify_shard(self, index: int) -> str | None:
        """Why shard `index` is corrupt, or None; a shard already in the node cache was verified when cached."""
        stream, local = self.owners[index]
        cache = self.caches[stream]
        if cache.is_cached(local):
            return None
        try:
            cache.open(local).close()
        except CorruptShardError as err:
            return err.reason
        return None

    def batch_format(self) -> dict[str, Any]:
        """Sample length, token dtype, padding id and whether batches carry document boundaries."""
        first = self.manifests[0]
        tok = first.tokenizer
        return {"sample_length": first.sample_length, "token_dtype": numpy_token_dtype(first.token_dtype),
                "pad_id": next((i for i in (tok.pad_id, tok.eos_id) if i is not None), 0),
                "with_segments": all(bool(m.columns.has_doc_boundaries.all()) for m in self.manifests)}


def holds_manifest(url: str, storage_options: dict[str, Any] | None) -> bool:
    """Whether `url` is a built dataset (holds the manifest); a glob never is."""
    return not has_magic(url) and Storage(url, storage_options).exists(MANIFEST_NAME)


def streams_of(source: Any) -> list[Stream]:
    """The streams of a `StreamingDataset` source: a URL (or path), a `Stream`, or a list of `Stream`.

    Raises:
        TypeError: anything else.
        ValueError: a raw-text stream (those need a tokenizer: `shardkit.loaders.sources.mixture`).
    """
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if isinstance(source, str):
        source = Stream(source)
    if isinstance(source, Stream):
        return [source]
    streams = list(source) if isinstance(source, (list, tuple)) else None
    if not streams or not all(isinstance(s, Stream) for s in streams):
        raise TypeError(f"source must be a dataset URL (str), a Stream, or a non-empty list of Stream, "
                        f"got {type(source).__name__} {source!r}"[:300])
    raw = next((s for s in streams if s.raw_text), None)
    if raw is not None:
        raise ValueError(f"stream {raw.url} is raw text (raw_text=True): a mixture with raw text needs the "
                         "mixture's tokenizer= and seq_len= (StreamingDataset(streams, tokenizer=SPEC, seq_len=N))")
    return streams


def check_mixable(streams: Sequence[Stream], manifests: Sequence[Manifest]) -> None:
    """Raise when the streams' samples cannot share batches (token dtype, sample length, tokenizer).

    Raises:
        ValueError: naming both streams and the value that differs.
    """
    first = manifests[0]
    for stream, manifest in zip(streams[1:], manifests[1:]):
        for attr in ("token_dtype", "sample_length"):
            if getattr(manifest, attr) != getattr(first, attr):
                raise ValueError(f"stream {stream.url}: {attr}={getattr(manifest, attr)!r} differs from "
                                 f"{streams[0].url} ({getattr(first, attr)!r}); streams of a mixture must agree")
        tok, ref = manifest.tokenizer, first.tokenizer
        if tok.vocab_size != ref.vocab_size or tok.name != ref.name:
            raise ValueError(f"stream {stream.url} uses tokenizer {manifest.tokenizer.name} "
                             f"({manifest.tokenizer.vocab_size} ids), {streams[0].url} uses "
                             f"{first.tokenizer.name} ({first.tokenizer.vocab_size} ids)")


def check_options_fit(config: LoaderConfig, streams: Sequence[Stream], manifests: Sequence[Manifest]) -> None:
    """The checks of options against the data they read (the options among themselves: `LoaderConfig`).

    Raises:
        ValueError: naming the option.
    """
    if config.epoch_size is not None and len(streams) == 1:
        raise ValueError("epoch_size applies to mixtures of several Streams only")
    if config.skip_samples and len(streams) > 1:
        raise ValueError(f"skip_samples applies to a single dataset, not a mixture of {len(streams)} Streams")
    longest = max((m.max_sample_tokens or 0) for m in manifests)
    if config.max_tokens is not None and longest > config.max_tokens:
        raise ValueError(f"max_tokens={config.max_tokens} is below the longest sample the manifests allow "
                         f"(max_sample_tokens={longest}); raise max_tokens")
    if config.max_tokens is not None and any(isinstance(s.weight, Schedule) for s in streams):
        raise ValueError("weight Schedules need fixed-size batches (their steps become positions); "
                         "drop max_tokens or use fixed weights")
