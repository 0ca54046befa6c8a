"""A mixture's streams (`mixture.RawMixtureSource`): raw streams' corpora listed with the mixture's settings, built
streams' manifests fetched and checked against them (`open_streams`), and built samples read by global sample id
through their node caches (`BuiltSamples`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardkit.formats import Sample
from shardkit.formats.sample import numpy_token_dtype
from shardkit.manifest import Manifest

from ..config import LoaderConfig
from ..order.mixing import Stream
from ..state.fingerprint import data_fingerprint
from .built.streams import Sources
from .raw.corpus import RawCorpus


class BuiltSamples:
    """Built streams' samples by global sample id, read through their node caches; the shards a step reads are
    held until a step no longer reads them."""

    def __init__(self, sources: Sources | None):
        self.sources = sources
        self.held: dict[int, Any] = {}

    def read(self, shards: np.ndarray, sample_ids: np.ndarray) -> list[Sample]:
        """The samples `sample_ids` (global ids over the built streams) of the global shards `shards`."""
        if not len(sample_ids):
            return []
        owners, table = self.sources.owners, self.sources.table
        needed = set(shards.tolist())
        for index in [i for i in self.held if i not in needed]:
            self.held.pop(index).close()
        samples = []
        for shard, local in zip(shards.tolist(), table.locate(sample_ids)[1].tolist()):
            if shard not in self.held:
                stream, in_stream = owners[shard]
                self.held[shard] = self.sources.caches[stream].open(in_stream)
            sample = self.held[shard].reader.sample(local)
            if sample.doc_starts is None:  # a shard without document boundaries: the sample is one segment
                sample = Sample(sample.tokens, np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64))
            samples.append(sample)
        return samples

    def close(self) -> None:
        while self.held:
            self.held.popitem()[1].close()


@dataclass
class OpenedStreams:
    """A mixture's streams, opened: the raw streams' corpora, the built streams' sources, and per stream its
    lanes (0 for built), samples per shard (None for raw text), identity (its fingerprint) and work units."""

    corpora: list[RawCorpus] = field(default_factory=list)
    sources: Sources | None = None
    lanes: list[int] = field(default_factory=list)
    shard_sizes: list[np.ndarray | None] = field(default_factory=list)
    identities: list[str] = field(default_factory=list)
    legacy_identities: list[str] = field(default_factory=list)  # as version 1 states name them
    units: list[int] = field(default_factory=list)  # a raw stream's work units (0: built)


def open_streams(streams: list[Stream], first: RawCorpus, config: LoaderConfig, *,
                 storage_options: dict[str, Any] | None, cache_dir: str | None) -> OpenedStreams:
    """List every raw stream's units with `first`'s settings (`first` is the first raw stream's corpus) and fetch
    the built streams' manifests, checking each against the mixture.

    Raises:
        ValueError / OSError: as `RawCorpus`, `Sources` and `check_built_stream` raise them.
    """
    built = [s for s in streams if not s.raw_text]
    opened = OpenedStreams(sources=Sources(built, config, cache_dir=cache_dir,
                                           storage_options=storage_options) if built else None)
    manifests = iter(zip(opened.sources.manifests, opened.sources.shard_sizes) if built else ())
    for stream in streams:
        if stream.raw_text:
            corpus = RawCorpus([stream.url], first.settings, _options(stream, storage_options)) \
                if opened.corpora else first
            opened.corpora.append(corpus)
            opened.lanes.append(corpus.num_lanes)
            opened.units.append(len(corpus.units.size))
            opened.shard_sizes.append(None)
            opened.identities.append(corpus.fingerprint)
            opened.legacy_identities.append(corpus.legacy_fingerprint)
        else:
            manifest, sizes = next(manifests)
            check_built_stream(stream, manifest, first)
            opened.lanes.append(0)
            opened.units.append(0)
            opened.shard_sizes.append(sizes)
            opened.identities.append(data_fingerprint([manifest], []))
            opened.legacy_identities.append(opened.identities[-1])
    return opened


def _options(stream: Stream, default: dict[str, Any] | None) -> dict[str, Any] | None:
    return stream.storage_options if stream.storage_options is not None else default


def check_built_stream(stream: Stream, manifest: Manifest, corpus: RawCorpus) -> None:
    """Raise when a built stream's samples are not what the mixture's raw text makes (tokenizer, sample length,
    token dtype).

    Raises:
        ValueError: naming the stream, both values and what to do.
    """
    settings, info, tok = corpus.settings, corpus.tokenizer_info, manifest.tokenizer
    same_vocab = tok.vocab_sha256 == info.vocab_sha256 if tok.vocab_sha256 and info.vocab_sha256 else \
        (tok.kind, tok.name) == (info.kind, info.name)
    if not same_vocab or tok.vocab_size != info.vocab_size:
        raise ValueError(f"stream {stream.url}: built with tokenizer {tok.name} ({tok.vocab_size} ids), but the "
                         f"mixture's tokenizer= is {info.name} ({info.vocab_size} ids); rebuild it with that tokenizer "
                         "or leave it out")
    length = None if settings.pack == "none" else settings.seq_len + 1
    if manifest.sample_length != length or (manifest.seq_len not in (None, settings.seq_len)):
        raise ValueError(f"stream {stream.url}: holds samples of seq_len={manifest.seq_len} "
                         f"(packing={manifest.packing!r}), but the mixture's are seq_len={settings.seq_len} "
                         f"(pack={settings.pack!r}); rebuild it with --seq-len {settings.seq_len} or leave it out")
    if numpy_token_dtype(manifest.token_dtype) != np.dtype(corpus.token_dtype):
        raise ValueError(f"stream {stream.url}: token_dtype={manifest.token_dtype}, but the mixture's tokenizer "
                         f"gives {corpus.token_dtype}; rebuild it with the mixture's tokenizer or leave it out")
