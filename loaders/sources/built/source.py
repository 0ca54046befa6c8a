"""`BuiltSource`: one built dataset behind the Source contract (`loaders.source`), and as a mixture's child.

A `StreamingDataset` of one dataset builds it once, from its stream and config; the data loader holds the source
and never the dataset's attributes. What reads the data is the source's epoch engine (`engine.EpochEngine`: the
order, the batch mode, the reader, the order's part of the resume state), which a mixture of built datasets holds
too (`sources.mixture.MixtureSource`): the feed and the standalone iteration talk to the engine.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .engine import EpochEngine
from .feed import BuiltFeed
from .standalone import BuiltStandalone
from ...config import LoaderConfig
from ...order.epochs import Order
from ...order.mixing import Stream
from ...source import Feed, MixtureChild, Provenance, Source, Standalone, StreamPart
from .streams import Sources
from ...delivery.topology import Topology


class BuiltSource(Source, MixtureChild):
    """One built dataset: epochs of its shuffled global order (a weighted plan when a mixture was changed to it).

    Args:
        config: the loader options.
        stream: the dataset's stream.
        sources: its storage, manifest and cache, opened.
        topology_args: explicit rank, world_size, local_rank, local_world_size (None: resolved).
        group_args: process_group, device_mesh, mesh_dim (dropped when pickled to workers).
    """

    endless = False  # epochs of the global order

    def __init__(self, config: LoaderConfig, stream: Stream, sources: Sources, *,
                 topology_args: dict[str, int | None], group_args: dict[str, Any]):
        self.config, self.streams, self.sources = config, [stream], sources
        self._engine_args = dict(topology_args=topology_args, group_args=group_args)
        self._engine: EpochEngine | None = None

    @property
    def engine(self) -> EpochEngine:
        """What reads the dataset, built when first asked (a mixture of built datasets reads its children's shards
        through its own engine: theirs are never built)."""
        if self._engine is None:
            self._engine = EpochEngine(self.config, self.streams, self.sources, **self._engine_args)
        return self._engine

    @property
    def num_samples(self) -> int:
        return self.engine.num_samples

    @property
    def sample_length(self) -> int | None:  # type: ignore[override]
        return self.engine.sample_length

    @property
    def stored_token_dtype(self) -> Any:
        return self.engine.stored_token_dtype

    def order(self, epoch: int, num_partitions: int, quarantine: tuple[tuple[int, int, int], ...] = ()) -> Order:
        """The global order of `epoch` (`EpochEngine.order`)."""
        return self.engine.order(epoch, num_partitions, quarantine)

    def skipped_ids(self) -> np.ndarray:
        """The sample ids `skip_samples` leaves out (`EpochEngine.skipped_ids`)."""
        return self.engine.skipped_ids()

    def topology(self) -> Topology:
        return self.engine.topology()

    def identity(self) -> str:
        return self.engine.identity()

    def stream_identities(self) -> list[str]:
        return self.engine.stream_identities()

    def stream_records(self) -> list[dict[str, Any]]:
        return self.engine.stream_records()

    def provenance(self, sample_ids: Sequence[int], *, state: dict[str, Any] | None = None) -> Provenance:
        return self.engine.provenance(sample_ids)

    def shapes(self) -> list[tuple[str, Any]]:
        return self.engine.shapes()

    def describe(self) -> str:
        return self.engine.describe()

    def claim(self) -> None:
        self.engine.claim()

    def feed(self, loader: Any, batch_size: int | None) -> Feed:
        return BuiltFeed(self.engine, batch_size)

    def standalone(self, batch_size: int | None) -> Standalone:
        return BuiltStandalone(self.engine, batch_size)

    def batches(self, standalone: Standalone) -> Iterator[Any]:
        return self.engine.batches(standalone)

    # -- as a mixture's child (`MixtureChild`): read by shards -------------------------------------
    def mixture_part(self) -> StreamPart:
        return StreamPart(identity=self.identity(), legacy_identity=self.identity(),
                          shard_sizes=self.sources.shard_sizes[0])

    def open_shard(self, shard: int) -> Any:
        return self.sources.caches[0].open(shard)
