"""The provenance of built samples (`Source.provenance`): each sample's shard, its index there and its document
segments, read from the shard itself (whole, checked against the manifest's SHA-256, each shard once), never from
the corpus the shards were built from."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from shardkit.lineage import VerifiedShards, locate_samples, sample_segments
from shardkit.manifest import Manifest
from shardkit.storage import Storage

from ...source import Provenance, SampleProvenance


class ShardSamples:
    """Built streams' samples by (stream, id within the stream), for provenance: each shard read whole and verified
    once (a trace reads a few samples of a few shards; the node cache is for training)."""

    def __init__(self, storages: Sequence[Storage], manifests: Sequence[Manifest]):
        self._shards = [VerifiedShards(storage, manifest) for storage, manifest in zip(storages, manifests)]

    def provenance(self, stream: int, sample_id: int) -> SampleProvenance:
        """Sample `sample_id` of stream `stream`: its shard, its index there, its documents and tokens.

        Raises:
            IndexError: an id outside the stream, naming it and the stream's size.
        """
        shards = self._shards[stream]
        manifest = shards.manifest
        [(position, local)] = locate_samples(manifest, [sample_id])
        arrays = shards.arrays(position)
        place = {"dataset": shards.storage.display_url, "shard": manifest.shards[position].name,
                 "shard_index": local}
        documents = [dataclasses.asdict(s) for s in sample_segments(manifest, arrays, local)]
        return SampleProvenance(place=place, documents=documents, tokens=arrays.sample(local).tokens)


def built_provenance(storages: Sequence[Storage], manifests: Sequence[Manifest],
                     sample_ids: Sequence[int]) -> Provenance:
    """`Source.provenance` of built data: global ids count through the streams in turn (a mixture numbers its
    streams' samples one stream after the other).

    Raises:
        IndexError: an id outside the data, naming it and the data's size.
    """
    counts = [m.num_samples for m in manifests]
    starts = np.cumsum(counts) - counts
    total = int(sum(counts))
    shards = ShardSamples(storages, manifests)
    samples = {}
    for sample_id in dict.fromkeys(int(i) for i in sample_ids):
        if not 0 <= sample_id < total:
            raise IndexError(f"sample id {sample_id} is outside the data ({total:,} samples)")
        stream = int(np.searchsorted(starts, sample_id, side="right")) - 1
        samples[sample_id] = shards.provenance(stream, sample_id - int(starts[stream]))
    return Provenance(samples=samples)
