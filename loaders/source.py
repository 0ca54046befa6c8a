"""The Source contract: what `StreamingDataset` and `StreamingDataLoader` ask of any kind of input.

A source is one built dataset (`sources.built.source.BuiltSource`: epochs of a shuffled global order), raw text
(`sources.raw.source.RawTextSource`: lanes tokenized on the fly, endless) or a weighted mixture of streams of either
kind (`sources.mixture.MixtureSource`). The dataset and the loader are one class each and hold a source; nothing
outside a source asks which kind it is: what differs between kinds is a property or a method here. What reads a
source is its engine, the same for a single source and a mixture of its kind: the epoch engine for data read by
shards (`sources.built.engine.EpochEngine`), the lane engine for data read by lanes (`sources.raw.engine.LaneEngine`);
the feeds and standalone iterations talk to the engine.

Three roles, each small (torchdata.nodes' `BaseNode` and Grain's `MapDataset` are the size aimed at):

- `Source`: the data's identity, shape and topology, the batches `iter(dataset)` yields (a DataLoader
  worker's share of them, or whole batches when iterated in the loading process), and the provenance of a
  sample (`shardkit trace`);
- `Feed` (`Source.feed`): the loader's side of one source: its iteration, length and global resume state;
- `Standalone` (`Source.standalone`): the dataset iterated without `StreamingDataLoader` (torch's DataLoader,
  torchdata's `StatefulDataLoader`): its iteration, epoch and state, or a refusal that names the loader.

```
StreamingDataset ──holds──> Source ──feed()──────> Feed        <──delegates── StreamingDataLoader
                                   └─standalone()─> Standalone <──delegates── StreamingDataset (no loader)
```

A weighted mixture (`sources.mixture.MixtureSource`, one class for every kind of stream) is a Source over Sources:
each of its streams is a child Source that also answers `MixtureChild` (what the mixture asks of a stream: its part
in the order, and its items); the children's parts decide the mixture's engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True, kw_only=True)
class SampleProvenance:
    """Where one sample comes from (what `shardkit trace` shows of it).

    Attributes:
        place: where the source keeps the sample: {"dataset", "shard", "shard_index"} for a built shard's,
            {"dataset", "lane", "lane_sample", "lane_epoch"} for raw text's (`dataset`: the data's URL).
        documents: its document segments, each {"start", "end", "source", "source_name", "doc"}: tokens
            [start, end) of document `doc` (line, row or paragraph) of input `source_name` (source -1: padding);
            empty when the data records none.
        tokens: the sample's tokens, as the loader gives them.
    """

    place: dict[str, Any]
    documents: list[dict[str, Any]]
    tokens: Any


@dataclass(frozen=True, kw_only=True)
class Provenance:
    """`Source.provenance`'s answer: each sample id's `SampleProvenance`, and `reread`: samples the source made
    again to find them (raw text packs its lanes again; 0 where samples are read from shards)."""

    samples: dict[int, SampleProvenance] = field(default_factory=dict)
    reread: int = 0


class Source(ABC):
    """One kind of input behind the one dataset and loader.

    Attributes:
        endless: True when the source has no epoch end (raw text: each lane goes on epoch after epoch), so
            `len()` is refused and a training loop stops after a number of steps.
        sample_length: tokens per sample (seq_len + 1), None for variable-length samples.
    """

    endless: ClassVar[bool]
    sample_length: int | None

    @abstractmethod
    def identity(self) -> str:
        """What a loader state is bound to: the data and how it becomes samples (not where it is)."""

    @abstractmethod
    def stream_identities(self) -> list[str]:
        """Per stream, in sample-id order, the identity of its data (not its weight): what a run records so that
        `shardkit trace` can check it reads the same data again."""

    @abstractmethod
    def stream_records(self) -> list[dict[str, Any]]:
        """Per stream: {"url", "fingerprint", "num_samples"} (0 for endless streams), as a run records them."""

    def provenance(self, sample_ids: Sequence[int], *, state: dict[str, Any] | None = None) -> Provenance:
        """Where each of `sample_ids` (the ids the loader gives, `--log-sample-ids` logs) comes from: its place, its
        documents and its tokens. `state`: a loader state saved before those samples, from which a source that
        must make its samples again (raw text) may start instead of its beginning.

        Raises:
            IndexError: an id outside the data, naming it.
            ValueError: a source that cannot say (naming it).
        """
        raise ValueError(f"{self.describe()} cannot say where its samples come from: trace the data it reads")

    @abstractmethod
    def shapes(self) -> list[tuple[str, Any]]:
        """(what, shape) per stream: `shape` has `seq_len`, `sample_length`, `packing`, `tokenizer` and
        `token_dtype` (a built stream's `Manifest`), for the trainer's checks."""

    @abstractmethod
    def describe(self) -> str:
        """What the source reads, in a few words for messages."""

    @abstractmethod
    def topology(self) -> Any:
        """Rank, world and node layout, resolved now (`shardkit.loaders.delivery.topology.Topology`)."""

    @abstractmethod
    def claim(self) -> None:
        """A `StreamingDataLoader` drives this source from now on."""

    @abstractmethod
    def batches(self, standalone: Standalone) -> Iterator[Any]:
        """What `iter(dataset)` yields: in a DataLoader worker its share of each step for the loader, in the
        loading process the loader's numpy batches, and without a loader `standalone`'s tensors."""

    @abstractmethod
    def feed(self, loader: Any, batch_size: int | None) -> Feed:
        """The loader's side of this source (`loader`: the `StreamingDataLoader` that will drive it, whose options
        the feed may check; it keeps no reference: a loader dropped mid-iteration is freed at once)."""

    @abstractmethod
    def standalone(self, batch_size: int | None) -> Standalone:
        """The dataset's iteration without a loader."""


class Feed(ABC):
    """The loader's side of one source: the batches handed to the training loop and the global state.

    Attributes:
        samples_per_rank: samples per rank per step (None: the batches' sizes follow a token budget).
    """

    samples_per_rank: int | None

    @property
    @abstractmethod
    def epoch(self) -> int:
        """The epoch the next iteration reads (0 for endless sources)."""

    @abstractmethod
    def length(self) -> int:
        """Batches per epoch for this rank. Raises TypeError where there is no such number."""

    @abstractmethod
    def batches(self, loader: Any) -> Iterator[dict[str, Any]]:
        """The tensors handed to the training loop, from where `loader` (the `StreamingDataLoader`) stands."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The global resume state, identical on every rank."""

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's part of the state (a global state already needs nothing else)."""
        return self.state_dict()

    def global_state(self, local: dict[str, Any]) -> dict[str, Any]:
        """The global state of a `local_state_dict()` taken now or earlier at the same step on every rank (every
        rank calls it; a global state already is one)."""
        return local

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any], *, allow_mixture_change: bool = False) -> None:
        """Resume from a `state_dict()`, possibly saved with another world size, batch size or workers."""

    def counters(self) -> dict[str, int]:
        """What the loader counted so far (the same on every rank), by name."""
        return {}


class Standalone(ABC):
    """A dataset iterated without `StreamingDataLoader`."""

    @abstractmethod
    def batches(self) -> Iterator[dict[str, Any]]:
        """Tensors of this rank's batches, from where the standalone iteration stands."""

    @abstractmethod
    def length(self) -> int:
        """Batches per epoch. Raises TypeError where there is no such number."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Where the standalone iteration stands (or a ValueError naming `StreamingDataLoader`)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any], *, allow_mixture_change: bool = False) -> None:
        """Start the next standalone iteration where `state` stands."""

    @abstractmethod
    def set_epoch(self, epoch: int) -> None:
        """Epoch of the next standalone iteration."""


@dataclass(frozen=True, kw_only=True)
class StreamPart:
    """A child's part in a mixture's order (`MixtureChild.mixture_part`).

    Attributes:
        identity: its data's identity as a stream of its own (not its weight): the mixture record names it so.
        legacy_identity: the same by version 1 states' recipe.
        lanes: the lanes it is read by (raw text); 0: it is read by shards.
        units: its lanes' work units (the state's unreadable cuts number them per stream).
        shard_sizes: samples per shard, when it is read by shards (None when read by lanes).
    """

    identity: str
    legacy_identity: str
    lanes: int = 0
    units: int = 0
    shard_sizes: Any = None


class MixtureChild(ABC):
    """What a weighted mixture asks of the source of each of its streams; a kind of source joins a mixture by
    answering it (and `Source`'s `identity`, `shapes` and `provenance`).

    A child is read by lanes (item k of a lane is its sample k, read through `lane_stream`) or by shards (items are
    samples of its epochs' orders, read through `open_shard`); the mixture's order (`order.mixed_lanes.MixedOrder`)
    places both by `mixture_part()` alone, and numbers lanes, units and shards over its children in stream order.
    """

    @abstractmethod
    def mixture_part(self) -> StreamPart:
        """Its part in the mixture's order."""

    def lane_stream(self, lane: int, log: Any, cursor: tuple[int, ...], cuts: Any, *, seed_offset: int = 0,
                    global_lane: int | None = None, unit_offset: int = 0) -> Any:
        """Lane `lane`'s samples from `cursor` on (a `sources.raw.corpus.LaneStream`), seeded `seed_offset` after
        the config's seed, its lane and units numbered from `global_lane` / `unit_offset` in reports and cuts."""
        raise ValueError(f"{self.describe()} is not read by lanes")

    def lane_unit_count(self, lane: int) -> int:
        """Units in lane `lane`."""
        raise ValueError(f"{self.describe()} is not read by lanes")

    def unit_url(self, unit: int) -> str:
        """The file of work unit `unit` (numbered within this child)."""
        raise ValueError(f"{self.describe()} is not read by lanes")

    def open_shard(self, shard: int) -> Any:
        """Shard `shard` opened through the node cache (its `reader.sample(i)`; closed by the caller)."""
        raise ValueError(f"{self.describe()} is not read by shards")

    @abstractmethod
    def describe(self) -> str:
        """What the child reads, for messages."""
