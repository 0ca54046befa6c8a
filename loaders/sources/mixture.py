"""`MixtureSource`: a weighted mixture of streams, one Source over the streams' Sources, whatever they hold.

`StreamingDataset([Stream(url, w), ...])` mixes built datasets; with `tokenizer=` and `seq_len=` some streams may be
raw text (`Stream(glob, w, raw_text=True)`). Either way the dataset holds one `MixtureSource`, and so does a data
service; nothing outside it asks which streams it mixes. Its streams are child Sources (`source.MixtureChild`), and
what they answer (`mixture_part()`) decides how the mixture is read:

- every stream read by shards (built datasets): epochs of one global order over the streams' combined shard table,
  the weighted plan (`order.remix`) deciding each position's stream: the epoch engine a single built dataset reads
  by (`built.engine.EpochEngine`, with its batch modes, quarantine, partitions and token budgets);
- some stream read by lanes (raw text): endless steps whose rows fall on the raw streams' lanes and the built
  streams' samples (`order.mixed_lanes.MixedOrder`): the lane engine a single raw corpus is read by
  (`raw.engine.LaneEngine`), over the mixture's lanes (`mixture_lanes.MixtureLanes`).

```
MixtureSource ──engine──> EpochEngine (all children read by shards)  <── BuiltFeed, BuiltStandalone
      │       └─engine──> LaneEngine ──plan──> MixtureLanes           <── RawTextFeed, RawStandalone
      └─children──> BuiltSource | RawTextSource (each a Source of one stream)
```
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

from ..config import LoaderConfig
from ..delivery.topology import Topology
from ..order.mixing import Stream
from ..source import Feed, Provenance, Source, Standalone, StreamPart
from .built.engine import EpochEngine
from .built.feed import BuiltFeed
from .built.source import BuiltSource
from .built.standalone import BuiltStandalone
from .built.streams import Sources
from .mixture_lanes import MixtureLanes
from .raw.corpus import RawTextSettings
from .raw.engine import LaneEngine
from .raw.feed import RawTextFeed
from .raw.source import RawStandalone


class MixtureSource(Source):
    """A weighted mixture of streams (built datasets, raw text, or both): a Source over its streams' Sources.

    Build it with `of_built` (built datasets only) or `with_raw_text` (some streams raw text).

    Attributes:
        endless: False when every stream is read by shards (epochs), True when some stream is read by lanes.
        children: each stream's child Source, in stream order.
        engine: what reads the mixture (`EpochEngine` or `LaneEngine`), chosen by the children's parts.
    """

    def __init__(self, children: list[Any], *, engine: EpochEngine | LaneEngine, lanes: MixtureLanes | None = None):
        self.children, self.engine = children, engine
        self._lanes = lanes  # the lanes' plan when read by lanes (which also answers the Source's questions)
        self._about: Any = lanes if lanes is not None else engine
        self.endless = lanes is not None
        self.sample_length = engine.sample_length

    @classmethod
    def of_built(cls, config: LoaderConfig, streams: list[Stream], sources: Sources, *,
                 topology_args: dict[str, int | None], group_args: dict[str, Any]) -> MixtureSource:
        """A mixture of built datasets (`sources`: the streams opened together, their manifests checked), read by
        the epoch engine over their combined shard table, exactly as one dataset of several streams was."""
        engine = EpochEngine(config, streams, sources, topology_args=topology_args, group_args=group_args)
        # The children: each stream as a dataset of its own (a mixture's epoch size and quarantine list are the
        # mixture's, numbered over every stream's shards).
        alone = dataclasses.replace(config, epoch_size=None, quarantine_list=None)
        children = [BuiltSource(alone, stream, sources.of_stream(i), topology_args=topology_args,
                                group_args=group_args) for i, stream in enumerate(streams)]
        return cls(children, engine=engine)

    @classmethod
    def with_raw_text(cls, streams: Sequence[Stream], settings: RawTextSettings, config: LoaderConfig, *,
                      cache_dir: str | None = None, storage_options: dict[str, Any] | None = None,
                      topology_args: dict[str, int | None], group_args: dict[str, Any]) -> MixtureSource:
        """A mixture with raw-text streams (`MixtureLanes` says what is refused)."""
        lanes = MixtureLanes(streams, settings, config, cache_dir=cache_dir, storage_options=storage_options,
                             topology_args=topology_args, group_args=group_args)
        engine = LaneEngine(lanes, lanes.corpora, config, sample_length=lanes.sample_length,
                            topology_args=topology_args, group_args=group_args)
        return cls(lanes.children, engine=engine, lanes=lanes)

    @property
    def stream_parts(self) -> list[StreamPart]:
        """Each child's part in the order (what chose the engine)."""
        return self._lanes.stream_parts if self._lanes is not None else [c.mixture_part() for c in self.children]

    # -- what tests and tools read of a mixture ------------------------------------------------
    @property
    def order(self) -> Any:
        """The mixture's order: the lanes' `MixedOrder`, or the epoch engine's `order(epoch, partitions, ...)`."""
        return self._lanes.order if self._lanes is not None else self.engine.order

    @property
    def corpora(self) -> list[Any]:
        """The raw streams' corpora."""
        return self._lanes.corpora if self._lanes is not None else []

    @property
    def rejected(self) -> Counter:
        """Rejected documents by reason, of the raw units this process started."""
        return self.engine.rejected if self._lanes is not None else Counter()

    # -- the Source contract -------------------------------------------------------------------
    def mixture_part(self) -> StreamPart:
        raise ValueError(f"{self.describe()} cannot be a stream of another mixture: list its streams instead")

    def identity(self) -> str:
        return self._about.identity()

    def stream_identities(self) -> list[str]:
        return self._about.stream_identities()

    def stream_records(self) -> list[dict[str, Any]]:
        return self._about.stream_records()

    def provenance(self, sample_ids: Sequence[int], *, state: dict[str, Any] | None = None) -> Provenance:
        return self._about.provenance(sample_ids, state=state)

    def shapes(self) -> list[tuple[str, Any]]:
        return self._about.shapes()

    def describe(self) -> str:
        return self._about.describe()

    def topology(self) -> Topology:
        return self.engine.topology()

    def claim(self) -> None:
        self.engine.claim()

    def batches(self, standalone: Standalone) -> Iterator[Any]:
        return self.engine.batches(standalone)

    def feed(self, loader: Any, batch_size: int | None) -> Feed:
        if self._lanes is not None:
            return RawTextFeed(self.engine, loader, batch_size)
        return BuiltFeed(self.engine, batch_size)

    def standalone(self, batch_size: int | None) -> Standalone:
        if self._lanes is not None:
            return RawStandalone(self.engine, batch_size)
        return BuiltStandalone(self.engine, batch_size)
