"""`RawTextSource`: train straight from raw text; the source of `StreamingDataset(inputs, tokenizer=..., seq_len=...)`.

The corpus is read by lanes (`order.lanes` for the order, `sources.raw.corpus` for the reading): each rank builds the
rows of its slice of every global step from the lanes they fall in, tokenizing and packing only those lanes.
What reads it is its lane engine (`sources.raw.engine.LaneEngine`), which a mixture with raw-text streams holds too:
a `StreamingDataLoader` talks to the engine through its feed (`sources.raw.feed.RawTextFeed`: where the next iteration
starts, consumed positions and the lanes' cursors), and the engine asks this source, its plan, where the lanes are
and the state's order fields.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from shardkit.formats import Sample

from ...config import LoaderConfig
from ...delivery.resharding import check_not_resharded
from .batches import CURSORS_KEY, DRY_KEY, UNREADABLE_KEY
from .engine import LaneEngine
from .iteration import RawIteration, StepPart
from ...order.lanes import NO_DRY_LANES, lane_sample_counts, rank_step_lanes
from .corpus import CURSOR_FIELDS, LaneRanDry, LaneStream, RawCorpus, RawTextSettings, RejectionLog
from .dry_lanes import DryLane, log_dry, newly_dry
from .feed import RawTextFeed
from .provenance import position_provenance
from .unreadable import UnitCuts
from ...source import Feed, MixtureChild, Provenance, Source, Standalone, StreamPart
from ...state.loader_state import LoaderState
from ...delivery.tensors import batch_to_tensors
from ...delivery.topology import Topology

logger = logging.getLogger(__name__)


class RawTextSource(Source, MixtureChild):
    """Raw text, tokenized and packed on the fly (`StreamingDataset(inputs, tokenizer=..., seq_len=...)`).

    Args:
        inputs: files, directories, globs or fsspec URLs of JSONL (.gz/.zst), Parquet or .txt inputs.
        settings: how the text becomes samples (`RawTextSettings`).
        config: the loader options; raw text reads seed, shuffle (the lanes' unit orders, shuffled per lane epoch
            by default), token_dtype, segment_ids and on_corrupt (a unit that cannot be read: "raise", naming its
            file, or "skip" it on every rank alike: `shardkit.loaders.sources.raw.unreadable`).
        topology_args, group_args: the explicit topology and the process group or mesh (`StreamingDataset`).
        storage_options: fsspec options of remote inputs.
    """

    endless = True  # lanes go on epoch after epoch

    def __init__(self, inputs: str | Sequence[str], settings: RawTextSettings, config: LoaderConfig, *,
                 topology_args: dict[str, int | None], group_args: dict[str, Any],
                 storage_options: dict[str, Any] | None = None):
        self.inputs = [inputs] if isinstance(inputs, str) else list(inputs)
        self.corpus = RawCorpus(self.inputs, settings, storage_options)
        self.seed, self.shuffle, self.on_corrupt = config.seed, config.shuffle, config.on_corrupt
        self.sample_length = None if settings.pack == "none" else settings.seq_len + 1
        # What reads it (the feed and the standalone iteration talk to the engine); this source is its plan.
        self.engine = LaneEngine(self, [self.corpus], config, sample_length=self.sample_length,
                                 topology_args=topology_args, group_args=group_args)

    @property
    def num_lanes(self) -> int:
        return self.corpus.num_lanes

    def topology(self) -> Topology:
        return self.engine.topology()

    @property
    def rejected(self) -> Counter:
        """Rejected documents by reason, of the units this process started."""
        return self.engine.rejected

    def order_values(self) -> dict[str, Any]:
        """The state's order fields: what the samples depend on."""
        return {"dataset": self.identity(), "seed": self.seed, "shuffle": self.shuffle, "num_partitions": self.num_lanes}

    def identity_parts(self) -> dict[str, Any] | None:
        """The identity part by part (`RawCorpus.identity_parts`), so that a refused resume names what differs."""
        return self.corpus.identity_parts

    def upgrade_legacy(self, saved: LoaderState) -> LoaderState:
        """A version 1 state with this data's identities as today's recipe makes them, where the old recipe's
        (absolute URLs, the tokenizer's spec) match this corpus (else unchanged: the comparison refuses it)."""
        if saved.dataset != self.corpus.legacy_fingerprint:
            return saved
        return replace(saved, dataset=self.identity())

    def raw_state(self) -> dict[str, Any]:
        """The state's `raw_text` fields besides the cursors (a mixture's record of its streams; none here)."""
        return {}

    def restore(self, raw_text: dict[str, Any], cursors: dict[int, tuple[int, ...]], cuts: UnitCuts, *,
                samples_consumed: int = 0, allow_mixture_change: bool = False
                ) -> tuple[dict[int, tuple[int, ...]], UnitCuts]:
        """Take the state's `raw_text` fields besides the cursors and cuts, and return those as this dataset
        numbers its lanes and units (a mixture's plan may change its streams and weights at `samples_consumed`:
        `mixture_lanes.MixtureLanes.restore`)."""
        return cursors, cuts

    # With fewer lanes than readers some ranks or workers read nothing (`sources.raw.feed.warn_few_lanes` says why).
    few_lanes_idle_readers = True

    def lane_stream(self, lane: int, log: RejectionLog, cursor: tuple[int, ...], cuts: UnitCuts, *,
                    seed_offset: int = 0, global_lane: int | None = None, unit_offset: int = 0) -> LaneStream:
        """Lane `lane`'s stream of samples from `cursor` on, its units read as `cuts` say (as a mixture's child:
        `MixtureChild.lane_stream`)."""
        return LaneStream(self.corpus, lane, log, seed=self.seed + seed_offset, shuffle=self.shuffle, cursor=cursor,
                          cuts=cuts, skip_unreadable=self.on_corrupt == "skip", global_lane=global_lane,
                          unit_offset=unit_offset)

    def mixture_part(self) -> StreamPart:
        """Read by its lanes (`MixtureChild`)."""
        corpus = self.corpus
        return StreamPart(identity=corpus.fingerprint, legacy_identity=corpus.legacy_fingerprint,
                          lanes=corpus.num_lanes, units=len(corpus.units.size))

    # A lane that runs dry leaves the order (`sources.raw.dry_lanes`); a mixture's plan has no place for that.
    skips_dry_lanes = True

    def lane_counts(self, samples_consumed: int, dry: Mapping[int, int] = NO_DRY_LANES) -> np.ndarray:
        """Samples of each lane among the first `samples_consumed` positions (the lanes that ran dry: `dry`)."""
        return lane_sample_counts(samples_consumed, self.num_lanes, dry)

    def lane_unit_count(self, lane: int) -> int:
        """Units in lane `lane` (each lane epoch reads them all, in its own order)."""
        return len(self.corpus.lanes[lane])

    def unit_url(self, unit: int) -> str:
        """The file of unit `unit` (as cuts number units)."""
        return self.corpus.unit_url(unit)

    def claim(self) -> None:
        self.engine.claim()

    def prepare(self, iteration: RawIteration) -> None:
        """Nothing to fix before an iteration travels to the workers (`engine.LanePlan.prepare`)."""

    # -- what the dataset and the trainer ask ----------------------------------------------------
    def identity(self) -> str:
        """Identity of the inputs and of how they become samples."""
        return self.corpus.fingerprint

    def stream_identities(self) -> list[str]:
        return [self.corpus.fingerprint]

    def stream_records(self) -> list[dict[str, Any]]:
        return [{"url": ",".join(self.inputs), "fingerprint": self.identity(), "num_samples": 0}]

    def provenance(self, sample_ids: Sequence[int], *, state: dict[str, Any] | None = None) -> Provenance:
        # A position's lane depends on the lanes that ran dry before it: replayed from the state's position on.
        return position_provenance(self, sample_ids, state)

    def shapes(self) -> list[tuple[str, Any]]:
        return [(self.describe(), raw_shape(self.corpus, self.sample_length))]

    def describe(self) -> str:
        return f"raw text {', '.join(self.inputs)} (pack={self.corpus.settings.pack!r})"

    def feed(self, loader: Any, batch_size: int | None) -> Feed:
        return RawTextFeed(self.engine, loader, batch_size)

    def standalone(self, batch_size: int | None) -> Standalone:
        return RawStandalone(self.engine, batch_size)

    # -- reading (the engine asks its plan) ------------------------------------------------------
    def batches(self, standalone: Standalone) -> Iterator[Any]:
        return self.engine.batches(standalone)

    def parts(self, iteration: RawIteration, *, worker: int, num_workers: int) -> Iterator[StepPart]:
        """Per step, the rows of this rank's slice whose lanes belong to `worker` (lane % num_workers): one part
        per step, empty or not, so the DataLoader's round robin over workers keeps the parts of a step together."""
        topology = iteration.topology
        readers = LaneReaders(self, iteration)
        step = 0
        while True:
            positions, lanes, indices = rank_step_lanes(step, start=iteration.start, world_size=topology.world_size,
                                                        batch_size=iteration.batch_size, rank=topology.rank,
                                                        num_lanes=self.num_lanes, dry=iteration.dry)
            rows = np.flatnonzero(lanes % num_workers == worker) if num_workers > 1 else np.arange(len(lanes))
            part = StepPart(rows=rows, positions=positions[rows])
            for lane, index in zip(lanes[rows].tolist(), indices[rows].tolist()):
                sample, epoch = readers.take(lane, index, part)
                part.samples.append(sample)
                part.epochs.append(epoch)
            part.cursors = readers.cursor_rows(lanes[rows])
            step += 1
            yield part

    def row_columns(self, sample_ids: np.ndarray) -> dict[str, np.ndarray]:
        """The per-row columns a batch holds besides the samples' own (a mixture's `stream`; none here)."""
        return {}


@dataclass(frozen=True)
class RawTextShape:
    """What the trainer reads of raw text's samples (a built stream's `Manifest` answers the same)."""

    seq_len: int
    sample_length: int | None
    packing: str
    tokenizer: Any
    token_dtype: str


def raw_shape(corpus: RawCorpus, sample_length: int | None) -> RawTextShape:
    """The shape of the samples `corpus` makes (for `Source.shapes`)."""
    return RawTextShape(seq_len=corpus.settings.seq_len, sample_length=sample_length, packing=corpus.settings.pack,
                        tokenizer=corpus.tokenizer_info, token_dtype=corpus.token_dtype)


class LaneReaders:
    """The lanes one process reads in an iteration, each started at the iteration's cursor when first read, with
    the iteration's cuts."""

    def __init__(self, plan: RawTextSource, iteration: RawIteration):
        self.plan, self.iteration = plan, iteration
        self.log, self.streams = RejectionLog(), {}
        self.dry: dict[int, Any] = {}  # lane -> a stand-in sample: lanes found dry in this iteration

    def take(self, lane: int, index: int, part: StepPart) -> tuple[Any, int]:
        """(sample `index` of `lane`, its lane epoch); rejections, unreadable units and a lane found dry reported
        in `part`'s. A dry lane gives a padding sample: the loader reads the step again without the lane."""
        if lane in self.dry:
            return self.dry[lane], 0
        stream = self.streams.get(lane)
        if stream is None:
            cursor = self.iteration.cursors.get(lane, (0,) * CURSOR_FIELDS)
            stream = self.streams[lane] = self.plan.lane_stream(lane, self.log, cursor, self.iteration.cuts)
        # each step's part counts the rejections of the segments it began, and the units it cut
        stream.rejected, stream.unreadable = part.rejected, part.unreadable
        try:
            return stream.take(index)
        except LaneRanDry as dry:
            if not self.plan.skips_dry_lanes:
                raise
            part.dry.append(DryLane(dry.lane, dry.samples, dry.inputs, str(dry)))
            corpus = self.plan.corpus
            self.dry[lane] = Sample(np.full(self.plan.sample_length or 1, corpus.pad_id, dtype=corpus.token_dtype),
                                    np.zeros(1, dtype=np.int64), np.full(1, -1, dtype=np.int64),
                                    np.zeros(1, dtype=np.int64))
            return self.dry[lane], 0

    def cursor_rows(self, lanes: np.ndarray) -> np.ndarray:
        """[lane, *cursor] of each of `lanes` (read already), by lane."""
        return np.array([[lane, *self.streams[lane].cursor.as_tuple()] for lane in sorted(set(lanes.tolist()))],
                        dtype=np.int64).reshape(-1, 1 + CURSOR_FIELDS)


class RawStandalone(Standalone):
    """Raw text iterated without `StreamingDataLoader`: from the start, endless; its resume state is the loader's."""

    epoch = 0

    def __init__(self, source: LaneEngine, batch_size: int | None):
        self.source, self.batch_size = source, batch_size  # the source's engine

    def batches(self) -> Iterator[dict[str, Any]]:
        source = self.source
        if self.batch_size is None:
            raise ValueError("iterating a raw-text StreamingDataset on its own needs batch_size=; or use "
                             "StreamingDataLoader")
        iteration = RawIteration(start=0, batch_size=self.batch_size, topology=source.topology())
        check_not_resharded(iteration.topology.world_size)
        source.check_corpus_agreed()
        if source.on_corrupt == "skip" and iteration.topology.world_size > 1:
            raise ValueError("on_corrupt='skip' on several ranks needs StreamingDataLoader (the ranks agree on "
                             "what to skip through it)")
        return (batch_to_tensors({k: v for k, v in b.items() if k not in (CURSORS_KEY, UNREADABLE_KEY)},
                                 source.token_dtype)
                for b in self._without_dry_lanes(iteration))

    def _without_dry_lanes(self, iteration: RawIteration) -> Iterator[dict[str, Any]]:
        """The numpy batches from the start; where a lane runs dry, from the start again with the lane left out
        of the order (`sources.raw.dry_lanes`: the steps before it keep their rows), skipping the steps handed out.
        One rank only: several ranks need StreamingDataLoader to agree on it."""
        handed_out = 0
        while True:
            for step, batch in enumerate(self.source.step_batches(iteration)):
                found = newly_dry([batch.pop(DRY_KEY)], iteration.dry)
                if found and iteration.topology.world_size > 1:
                    raise ValueError(f"{found[0].message} (several ranks iterating a raw-text StreamingDataset on "
                                     "their own cannot agree on leaving it out: iterate StreamingDataLoader)")
                if found:
                    iteration = replace(iteration, dry={**iteration.dry, **{d.lane: d.samples for d in found}})
                    log_dry(found, num_lanes=self.source.num_lanes, dry=iteration.dry)
                    break
                if step == handed_out:
                    handed_out += 1
                    yield batch

    def length(self) -> int:
        raise TypeError("a raw-text StreamingDataset has no length: its lanes go on epoch after epoch (stop after a "
                        "number of steps: shardkit train --steps)")

    def state_dict(self) -> dict[str, Any]:
        # torchdata's `StatefulDataLoader` calls this; without it, it would resume by reading every consumed batch
        # again.
        raise ValueError("a raw-text StreamingDataset keeps no resume state of its own: iterate "
                         "StreamingDataLoader(dataset, batch_size=N) and save its state_dict() (the lanes' cursors; "
                         "it resumes exactly, on any number of ranks and workers), not torchdata's StatefulDataLoader")

    def load_state_dict(self, state: dict[str, Any], *, allow_mixture_change: bool = False) -> None:
        self.state_dict()  # the same refusal

    def set_epoch(self, epoch: int) -> None:
        self.state_dict()  # the same refusal: an epoch means nothing to endless lanes, the loader keeps the place
