"""A mixture's streams (`mixture_lanes.MixtureLanes`, read by lanes), each a child Source that answers `source.MixtureChild`: raw
streams as `RawTextSource`s listed with the mixture's settings, built streams as one-dataset `BuiltSource`s whose
manifests are checked against them (`open_children`), and the built children's samples read by global sample id
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
from ..order.shard_table import ShardTable
from ..source import MixtureChild, StreamPart
from .built.reading import ShardOwners
from .built.source import BuiltSource
from .built.streams import Sources, check_mixable, check_options_fit
from .raw.corpus import RawCorpus
from .raw.source import RawTextSource


class BuiltSamples:
    """The samples of the children read by shards, by global sample id (numbered over those children's shards in
    stream order); the shards a step reads are held until a step no longer reads them."""

    def __init__(self, children: list[MixtureChild], shard_sizes: list[np.ndarray]):
        self.children = children
        self.owners = ShardOwners([len(sizes) for sizes in shard_sizes])
        self.table = ShardTable.of_streams(shard_sizes)
        self.held: dict[int, Any] = {}

    def read(self, shards: np.ndarray, sample_ids: np.ndarray) -> list[Sample]:
        """The samples `sample_ids` (global ids over the built streams) of the global shards `shards`."""
        if not len(sample_ids):
            return []
        needed = set(shards.tolist())
        for index in [i for i in self.held if i not in needed]:
            self.held.pop(index).close()
        samples = []
        for shard, local in zip(shards.tolist(), self.table.locate(sample_ids)[1].tolist()):
            if shard not in self.held:
                child, in_child = self.owners[shard]
                self.held[shard] = self.children[child].open_shard(in_child)
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
    """A mixture's streams, opened: per stream its child Source and its part in the order (`StreamPart`)."""

    children: list[Any] = field(default_factory=list)
    parts: list[StreamPart] = field(default_factory=list)

    @property
    def corpora(self) -> list[RawCorpus]:
        """The raw children's corpora (what the ranks agree on before the first batch)."""
        return [child.corpus for child, part in zip(self.children, self.parts) if part.lanes]

    def read_by_shards(self) -> tuple[list[Any], list[np.ndarray]]:
        """The children read by shards, and their samples per shard, in stream order."""
        pairs = [(child, part.shard_sizes) for child, part in zip(self.children, self.parts) if not part.lanes]
        return [child for child, _ in pairs], [sizes for _, sizes in pairs]


def open_children(streams: list[Stream], first: RawTextSource, config: LoaderConfig, *,
                  storage_options: dict[str, Any] | None, cache_dir: str | None,
                  child_args: dict[str, Any]) -> OpenedStreams:
    """Each stream's child Source: `first` for the first raw stream, the built streams (manifests fetched and
    checked together), then the other raw streams listed with `first`'s settings, each built stream checked against
    the mixture in stream order (the order of checks a mixture always made).

    Raises:
        ValueError / OSError: as `RawCorpus`, `Sources`, `check_mixable` and `check_built_stream` raise them.
    """
    built = [s for s in streams if not s.raw_text]
    opened = [Sources([s], config, cache_dir=cache_dir, storage_options=storage_options) for s in built]
    if built:
        manifests = [sources.manifests[0] for sources in opened]
        check_mixable(built, manifests)
        check_options_fit(config, built, manifests)
    built_sources, first_raw = iter(opened), True
    children: list[Any] = []
    for stream in streams:
        if not stream.raw_text:
            sources = next(built_sources)
            check_built_stream(stream, sources.manifests[0], first.corpus)
            children.append(BuiltSource(config, stream, sources, **child_args))
        elif first_raw:
            children.append(first)
            first_raw = False
        else:
            children.append(RawTextSource(stream.url, first.corpus.settings, config,
                                          storage_options=_options(stream, storage_options), **child_args))
    return OpenedStreams(children=children, parts=[child.mixture_part() for child in children])


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
