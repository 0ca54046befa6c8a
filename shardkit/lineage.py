"""Lineage: which documents a sample holds, and which samples hold a document, from the shards' provenance.

Every packed sample stores its document segments (`doc_starts`, `doc_source`, `doc_index`, see
`shardkit.formats.sample`): the source is an index into the manifest's `sources` (the build's input
files), the document index is the record's 0-based line, row or paragraph there. This module reads
those arrays; the corpus itself is never read. `shardkit trace` and the loader's `skip_samples`
(documents resolved to sample ids) use it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardkit.formats.sample import Sample, ShardArrays
from shardkit.manifest import Manifest


@dataclass(frozen=True, kw_only=True)
class Segment:
    """Tokens [start, end) of a sample, taken from document `doc` of input `source` (-1: padding)."""

    start: int
    end: int
    source: int
    source_name: str | None
    doc: int


def shard_starts(manifest: Manifest) -> np.ndarray:
    """Global id of each shard's first sample (sample ids follow the manifest's shard order)."""
    sizes = np.array([s.samples for s in manifest.shards], dtype=np.int64)
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if len(sizes) else sizes


def locate_samples(manifest: Manifest, sample_ids: Iterable[int]) -> list[tuple[int, int]]:
    """(shard position, index within the shard) of each global sample id.

    Raises:
        IndexError: an id outside the dataset, naming it and the dataset's size.
    """
    starts, total = shard_starts(manifest), manifest.num_samples
    located = []
    for sample_id in sample_ids:
        if not 0 <= sample_id < total:
            raise IndexError(f"sample {sample_id} is out of range: the dataset holds {total:,} samples")
        shard = int(np.searchsorted(starts, sample_id, side="right")) - 1
        while manifest.shards[shard].samples == 0:  # empty shards share their start with the next one
            shard += 1
        located.append((shard, int(sample_id - starts[shard])))
    return located


def sample_segments(manifest: Manifest, arrays: ShardArrays, local: int) -> list[Segment]:
    """The document segments of sample `local` of a shard (empty when the shard stores none)."""
    return segments_of(arrays.sample(local), manifest.sources)


def segments_of(sample: Sample, sources: Sequence[str]) -> list[Segment]:
    """The document segments of `sample` (empty when it records none), naming each source from `sources` (a
    manifest's inputs, or a raw-text corpus's files)."""
    if sample.doc_starts is None:
        return []
    bounds = [*(int(s) for s in sample.doc_starts), len(sample.tokens)]
    segments = []
    for j in range(len(sample.doc_starts)):
        source = int(sample.doc_source[j])
        segments.append(Segment(start=bounds[j], end=bounds[j + 1], source=source, doc=int(sample.doc_index[j]),
                                source_name=sources[source] if 0 <= source < len(sources) else None))
    return segments


class VerifiedShards:
    """One dataset's shards, each read whole and checked against the manifest's SHA-256 at most once: tracing
    reads a few samples of a few shards (the node cache is for training).

    Args:
        storage: where the dataset is (`shardkit.storage.Storage`).
        manifest: its manifest.
    """

    def __init__(self, storage: Any, manifest: Manifest):
        self.storage, self.manifest = storage, manifest
        self._arrays: dict[int, ShardArrays] = {}

    def arrays(self, position: int) -> ShardArrays:
        """The arrays of the shard at `position` in the manifest."""
        if position not in self._arrays:
            from shardkit.formats.fetch import read_shard
            from shardkit.formats.reader import ShardReader

            shard = self.manifest.shards[position]
            self._arrays[position] = read_shard(self.storage, shard, decode=lambda data: ShardReader.from_bytes(
                data, shard=shard, manifest=self.manifest, verify=False)).arrays
        return self._arrays[position]


def source_index(manifest: Manifest, name: str) -> int:
    """The index in `manifest.sources` of input `name`: the exact entry, else the one entry that is the
    same file (`name` a path to it) or ends with `/name`.

    Raises:
        ValueError: no source or several match, naming some of them.
    """
    sources = manifest.sources
    if name in sources:
        return sources.index(name)
    absolute = os.path.abspath(name)
    matches = [i for i, s in enumerate(sources)
               if s.removeprefix("file://") == absolute or s.endswith("/" + name.lstrip("/"))]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ValueError(f"source {name!r} matches {len(matches)} inputs ("
                         + ", ".join(sources[i] for i in matches[:5]) + "); give more of its path")
    shown = ", ".join(sources[:5]) + (", ..." if len(sources) > 5 else "")
    raise ValueError(f"source {name!r} is not an input of this dataset (its {len(sources)} sources: {shown or 'none'})")


def samples_holding(arrays: ShardArrays, documents: Iterable[tuple[int, int]]) -> dict[tuple[int, int], np.ndarray]:
    """Per (source index, doc index): the indices (within the shard) of the samples holding a piece of it."""
    if arrays.doc_offsets is None:
        return {}
    found = {}
    for source, doc in documents:
        segments = np.flatnonzero((arrays.doc_source == source) & (arrays.doc_index == doc))
        if segments.size:
            found[(source, doc)] = np.unique(np.searchsorted(arrays.doc_offsets, segments, side="right") - 1)
    return found


def find_documents(manifest: Manifest, documents: Iterable[tuple[int, int]],
                   arrays_of: Callable[[int], ShardArrays]) -> dict[tuple[int, int], np.ndarray]:
    """Global sample ids holding each (source index, doc index), reading every shard's provenance once.

    Args:
        manifest: the dataset.
        documents: (index into `manifest.sources`, document index) pairs.
        arrays_of: the arrays of shard position i (a verified read, or the loader's cache).

    Raises:
        ValueError: the dataset stores no document provenance (built without document boundaries).
    """
    documents = sorted(set(documents))
    if not any(s.has_doc_boundaries for s in manifest.shards):
        raise ValueError("the dataset stores no document provenance (no shard has document boundaries); "
                         "rebuild it with packing that records them (concat or bestfit)")
    starts = shard_starts(manifest)
    found: dict[tuple[int, int], list[np.ndarray]] = {d: [] for d in documents}
    for position, shard in enumerate(manifest.shards):
        if not shard.has_doc_boundaries or shard.samples == 0:
            continue
        for document, local in samples_holding(arrays_of(position), documents).items():
            found[document].append(local + starts[position])
    return {d: np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64) for d, ids in found.items()}
