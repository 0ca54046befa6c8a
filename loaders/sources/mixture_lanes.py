"""`MixtureLanes`: the lanes of a weighted mixture with raw-text streams, the plan its lane engine reads by
(`sources.raw.engine.LanePlan`) for `sources.mixture.MixtureSource`.

The order is `order.mixed_lanes.MixedOrder` (pure); each stream is a child Source (`source.MixtureChild`: a
`RawTextSource`, or a `BuiltSource` of one dataset; `mixture_streams.open_children`) and the plan reads its rows
through them: a raw stream's lanes through the child's `lane_stream`, as the stream's own dataset reads them (seeded
with the stream's seed key), a built stream's samples through its `open_shard`. Its lanes are every raw stream's
lanes in stream order (a global lane number), so the raw-text feed (`sources.raw.feed.RawTextFeed`) saves and resumes
it as it does one corpus: `samples_consumed` and one cursor per global lane, O(lanes + streams), elastic like a raw
dataset's state. The state's `raw_text` also records the streams (`streams`), so that a mixture's state and a
single raw dataset's are told apart, and the mixture's record (`mixture`, `remix.MixtureRecord`, as a built mixture
keeps it): a resume with `allow_mixture_change` may change the streams' weights, and the mixture continues from the
saved position with each stream's count there (nothing a stream gave is repeated); its streams themselves stay (a
raw stream's lanes and sample ids depend on the raw streams there are).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from ..config import LoaderConfig
from ..order.mixing import Stream
from .raw.source import LaneReaders, RawTextSource, raw_shape
from .raw.iteration import RawIteration, StepPart
from ..order.mixed_lanes import ENDLESS, MixedOrder
from .raw.corpus import LaneStream, RawTextSettings, RejectionLog
from .raw.unreadable import UnitCuts
from ..order.remix import MixtureRecord, MixtureStreams, changed_record, fresh_record
from ..order.schedule import weight_spec
from ..state.loader_state import LoaderState
from .mixture_streams import BuiltSamples, _options, open_children
from .raw.provenance import LanePlace, checked_ids, lane_provenance, saved_raw_text
from ..source import Provenance

logger = logging.getLogger(__name__)


class MixtureLanes:
    """Raw-text and built streams in one weighted mixture, read by lanes: its lanes are the raw streams' lanes in
    stream order.

    Args:
        streams: the mixture's `Stream`s; raw text ones marked `raw_text=True` (at least one), the others built
            datasets made with the mixture's tokenizer and sequence length. A weight may be a `Schedule` (its steps
            are global batches of the first run).
        settings, config: as `RawTextSource` (lanes: per raw stream); the config's cache options apply to the built
            streams.
        cache_dir: node-local cache of the built streams' shards.
        storage_options: fsspec options of streams that have none of their own.
        **options: the children's topology and process group (`RawTextSource`'s topology_args, group_args).

    Raises:
        ValueError: no raw-text stream, a weight too small to be sampled, or a built stream whose tokenizer, sample
            length or token dtype differs from the mixture's (naming it).
    """

    def __init__(self, streams: Sequence[Stream], settings: RawTextSettings, config: LoaderConfig, *,
                 cache_dir: str | None = None, storage_options: dict[str, Any] | None = None, **options: Any):
        streams = list(streams)
        raw = [s for s in streams if s.raw_text]
        if not raw:
            raise ValueError("a StreamingDataset with tokenizer= mixes raw text: mark its raw-text streams "
                             "Stream(url, weight, raw_text=True), or drop tokenizer= for a mixture of built datasets")
        # The first raw stream is listed first: its corpus sets the settings and tokenizer the others are checked by.
        first = RawTextSource(raw[0].url, settings, config, storage_options=_options(raw[0], storage_options),
                              **options)
        self.corpus, self.seed, self.shuffle, self.sample_length = first.corpus, first.seed, first.shuffle, \
            first.sample_length
        opened = open_children(streams, first, config, storage_options=storage_options, cache_dir=cache_dir,
                               child_args=options)
        parts = opened.parts
        described = MixtureStreams(urls=[s.url for s in streams], fingerprints=[p.identity for p in parts],
                                   weights=[s.weight for s in streams], epoch_size=ENDLESS, policy="drop")
        self.record = record = fresh_record(described)  # replaced by the saved (or changed) one on resume
        self.order = MixedOrder(record.plan, [p.lanes for p in parts], [p.shard_sizes for p in parts],
                                seed=self.seed, shuffle=self.shuffle)
        self._identity, self._legacy_identity = (
            hashlib.sha256(json.dumps([[identity, weight_spec(s.weight), s.raw_text]
                                       for identity, s in zip(identities, streams)]).encode()).hexdigest()
            for identities in ([p.identity for p in parts], [p.legacy_identity for p in parts]))
        self._legacy_streams = {p.legacy_identity: p.identity for p in parts}
        # The children: one Source per stream (`source.MixtureChild`); those read by lanes and those read by shards.
        self.streams, self.children, self.stream_parts, self.corpora = streams, opened.children, parts, opened.corpora
        self.by_shards = opened.read_by_shards()
        self.stream_entries = [[s.url, weight_spec(s.weight), s.raw_text, p.lanes, p.units]
                               for s, p in zip(streams, parts)]
        self.described = described
        # Units are numbered over the lane-read streams in stream order (as the state's cuts name them).
        lane_streams = np.flatnonzero(self.order.lanes > 0).tolist()
        units = [parts[s].units for s in lane_streams]
        self.unit_offsets = np.cumsum(units) - units
        self.unit_streams = lane_streams
        # global lane -> (its stream, lane in its child, the stream's first unit number)
        self.lane_owners = [(s, lane, int(offset)) for s, offset in zip(lane_streams, self.unit_offsets)
                            for lane in range(parts[s].lanes)]

    def identity(self) -> str:
        """Identity of the streams, their weights and how raw text becomes samples."""
        return self._identity

    def order_values(self) -> dict[str, Any]:
        """The state's order fields: what the samples depend on (`RawTextSource.order_values`)."""
        return {"dataset": self.identity(), "seed": self.seed, "shuffle": self.shuffle, "num_partitions": self.num_lanes}

    def identity_parts(self) -> dict[str, Any] | None:
        return None  # a refused mixture names its streams and weights (`_changed`)

    def upgrade_legacy(self, saved: LoaderState) -> LoaderState:
        """A version 1 state with its raw streams' identities as today's recipe makes them, where the old
        recipe's match this mixture's streams."""
        raw_text = dict(saved.raw_text or {})
        if isinstance(raw_text.get("mixture"), dict):
            record = raw_text["mixture"]
            raw_text["mixture"] = {**record, "streams": [
                {**s, "identity": self._legacy_streams.get(s.get("identity"), s.get("identity"))}
                if isinstance(s, dict) else s for s in record.get("streams") or ()]}
        dataset = self._identity if saved.dataset == self._legacy_identity else saved.dataset
        return replace(saved, dataset=dataset, raw_text=raw_text)

    def stream_identities(self) -> list[str]:
        """Per stream, its data identity (a raw stream's corpus fingerprint, a built stream's shards), not its
        weight: a weight change keeps them."""
        return [s.identity for s in self.record.streams]

    def stream_records(self) -> list[dict[str, Any]]:
        # ids count through the streams as `order.mixed_lanes` numbers them; endless: no sample count
        return [{"url": s.url, "fingerprint": identity, "num_samples": 0}
                for s, identity in zip(self.streams, self.stream_identities())]

    def provenance(self, sample_ids: Sequence[int], *, state: dict[str, Any] | None = None) -> Provenance:
        ids = checked_ids(sample_ids)
        streams, lanes, indexes = (a.tolist() for a in self.order.places_of_ids(ids))
        found = lane_provenance(self, {i: LanePlace(self.streams[s].url, lane, index) for i, s, lane, index
                                       in zip(ids.tolist(), streams, lanes, indexes) if lane >= 0},
                                saved_raw_text(state))
        # A row read by shards: its child's own provenance of its id there (each child asked once, for all its ids).
        asked: dict[int, dict[int, int]] = {}
        for i, s, lane, index in zip(ids.tolist(), streams, lanes, indexes):
            if lane < 0:
                asked.setdefault(s, {})[i] = index
        by_child = {s: self.children[s].provenance(list(dict.fromkeys(wanted.values()))).samples
                    for s, wanted in asked.items()}
        samples = {i: found.samples[i] if lane >= 0 else by_child[s][index]
                   for i, s, lane, index in zip(ids.tolist(), streams, lanes, indexes)}
        return Provenance(samples=samples, reread=found.reread)

    def shapes(self) -> list[tuple[str, Any]]:
        return [(self.describe(), raw_shape(self.corpus, self.sample_length))]

    def describe(self) -> str:
        return f"a mixture of {', '.join(s.url for s in self.streams)} (raw text pack={self.corpus.settings.pack!r})"

    @property
    def num_lanes(self) -> int:
        return self.order.total_lanes

    def raw_state(self) -> dict[str, Any]:
        """The state's record of the streams ([url, weight, raw text, lanes, units] each), the global batch that
        weight schedules count steps in (None until the first iteration) and the mixture record (its plan's
        anchor, the changes made and the streams removed)."""
        record = self.record
        if self.order.global_batch is not None:
            record = record.pinned(self.order.global_batch)
        return {"streams": self.stream_entries, "global_batch": self.order.global_batch, "mixture": record.to_dict()}

    def restore(self, raw_text: dict[str, Any], cursors: dict[int, tuple[int, ...]], cuts: UnitCuts, *,
                samples_consumed: int = 0, allow_mixture_change: bool = False
                ) -> tuple[dict[int, tuple[int, ...]], UnitCuts]:
        """Adopt the saved global batch and mixture record; with `allow_mixture_change` and other streams or weights
        than the saved ones, continue at `samples_consumed` with this mixture's (`remix.changed_record`: each stream
        from its count there, a new stream from its start). Returns the saved lane cursors and unit cuts numbered
        for this mixture's lanes and units (a removed raw stream's are dropped: its count stays in the record, and
        a stream added back is read again from its lanes' start up to it).

        Raises:
            ValueError: a damaged record, or other streams or weights without `allow_mixture_change`.
        """
        record = MixtureRecord.from_dict(raw_text["mixture"]) if raw_text.get("mixture") is not None else None
        global_batch = raw_text.get("global_batch")
        follow = None
        if record is not None:  # else saved before raw mixtures kept a record (the loader checked its weights)
            follow = record = record.pinned(global_batch) if global_batch is not None else record
            if _weights(record) != _weights(fresh_record(self.described)):
                follow = self._changed(record, samples_consumed, allow_mixture_change=allow_mixture_change)
                cursors, cuts = self._renumbered(raw_text, record, cursors, cuts)
        # Nothing is adopted before every check passed: a refused state leaves the loader as it was.
        if global_batch is not None:
            self.order.pin(global_batch, saved=True)
        if follow is not None:
            self.order.follow(follow.plan)
            self.record = follow
        return cursors, cuts

    def _changed(self, saved: MixtureRecord, position: int, *, allow_mixture_change: bool) -> MixtureRecord:
        """The record continuing `saved` at `position` with this mixture's streams and weights.

        Raises:
            ValueError: `allow_mixture_change` is off.
        """
        if not allow_mixture_change:
            before = [[s.url, weight_spec(s.weight)] for s in saved.streams]
            now = [[s.url, weight_spec(s.weight)] for s in fresh_record(self.described).streams]
            raise ValueError(f"cannot resume: the saved loader state's mixture has other streams or weights (saved "
                             f"{before}, now {now}); to continue with this mixture from the saved position, pass "
                             "allow_mixture_change=True (shardkit train: --allow-mixture-change)")
        changed = changed_record(saved, epoch=0, position=position, streams=self.described)
        change = changed.changes[-1]
        logger.info("mixture changed at step %d (position %d): %s -> %s", change["step"], position, change["old"],
                    change["new"])
        return changed

    def _renumbered(self, raw_text: dict[str, Any], saved: MixtureRecord, cursors: dict[int, tuple[int, ...]],
                    cuts: UnitCuts) -> tuple[dict[int, tuple[int, ...]], UnitCuts]:
        """The saved cursors and cuts, numbered by the saved streams' lanes and units, renumbered for this
        mixture's streams (matched by data identity).

        Raises:
            ValueError: the saved streams' record is damaged, or the state records cuts but not the saved raw
                streams' units (a state from before streams could change).
        """
        entries = raw_text.get("streams")
        lane_at, unit_at = {}, {}  # identity -> (first lane, lanes) / first unit, in the saved numbering
        lane, unit = 0, 0
        try:
            if len(entries) != len(saved.streams):
                raise ValueError
            for stream, entry in zip(saved.streams, entries):
                if not entry[2]:  # built
                    continue
                lanes = int(entry[3])
                lane_at[stream.identity] = (lane, lanes)
                unit_at[stream.identity] = unit
                lane += lanes
                unit = unit + int(entry[4]) if unit is not None and len(entry) > 4 else None
        except (TypeError, ValueError, IndexError):
            raise ValueError("cannot resume: the loader state's streams do not match its mixture record (a damaged or "
                             "edited state)") from None
        if len(cuts) and None in unit_at.values():
            raise ValueError("cannot change the streams of this mixture: its loader state records unreadable units "
                             "but not how many units each raw stream had (a state saved by an older shardkit); resume "
                             "once with the saved streams, then change them")
        new_cursors, new_cuts = {}, []
        raw = np.flatnonzero(self.order.lanes > 0).tolist()
        current = [stream.identity for stream in fresh_record(self.described).streams]
        for s, offset in zip(raw, self.unit_offsets):
            identity = current[s]
            if identity not in lane_at:
                continue  # a new stream: its lanes start at their beginning
            first, lanes = lane_at[identity]
            new_first = int(self.order.lane_offsets[s])
            if lanes != int(self.order.lanes[s]):
                raise ValueError(f"cannot resume: stream {self.stream_entries[s][0]} had {lanes} lanes, now "
                                 f"{int(self.order.lanes[s])} (the same data: a damaged or edited state)")
            for j in range(lanes):
                if first + j in cursors:
                    new_cursors[new_first + j] = cursors[first + j]
            units = self.stream_parts[s].units
            start = unit_at[identity]
            for cut in cuts.cuts:
                if start is not None and start <= cut.unit < start + units:
                    new_cuts.append(replace(cut, unit=cut.unit - start + int(offset)))
        return new_cursors, UnitCuts(tuple(new_cuts))

    def prepare(self, iteration: RawIteration) -> None:
        """Pin the plan's global batch (weight schedules count steps in it) before the workers take a copy."""
        self.order.pin(iteration.batch_size * iteration.topology.world_size)

    # A rank's slice of a step holds batch_size rows whatever the lanes: few lanes leave no rank idle.
    few_lanes_idle_readers = False

    def lane_stream(self, lane: int, log: RejectionLog, cursor: tuple[int, ...], cuts: UnitCuts) -> LaneStream:
        stream, local, unit_offset = self.lane_owners[lane]
        # The lanes' seed: the mixture's plus the stream's seed key (its index in the first mixture that had it).
        seed_key = self.record.streams[stream].seed_key
        return self.children[stream].lane_stream(local, log, cursor, cuts, seed_offset=seed_key, global_lane=lane,
                                                 unit_offset=unit_offset)

    skips_dry_lanes = False  # the plan's positions are its streams' items: a lane that runs dry stops the loader

    def lane_counts(self, samples_consumed: int, dry: Any = None) -> np.ndarray:
        return self.order.lane_counts(samples_consumed)  # never a dry lane (`skips_dry_lanes`)

    def lane_unit_count(self, lane: int) -> int:
        stream, local, _ = self.lane_owners[lane]
        return self.children[stream].lane_unit_count(local)

    def unit_url(self, unit: int) -> str:
        at = int(np.searchsorted(self.unit_offsets, unit, side="right")) - 1
        return self.children[self.unit_streams[at]].unit_url(unit - int(self.unit_offsets[at]))

    def parts(self, iteration: RawIteration, *, worker: int, num_workers: int) -> Iterator[StepPart]:
        """Per step, the rows of this rank's slice that `worker` reads (raw rows by lane, built rows by shard):
        one part per step, empty or not (see `RawTextSource.parts`)."""
        plan, topology = self, iteration.topology
        plan.order.pin(iteration.batch_size * topology.world_size)  # iterated without a loader: not pinned yet
        lanes, built = LaneReaders(plan, iteration), BuiltSamples(*self.by_shards)
        step = 0
        try:
            while True:
                rows = plan.order.step_rows(step, start=iteration.start, world_size=topology.world_size,
                                            batch_size=iteration.batch_size, rank=topology.rank)
                mine = np.flatnonzero(rows.worker_of(num_workers) == worker)
                part = StepPart(rows=mine, positions=rows.sample_id[mine])
                raw, from_built = mine[rows.lane[mine] >= 0], mine[rows.lane[mine] < 0]
                read = {row: lanes.take(int(rows.lane[row]), int(rows.index[row]), part) for row in raw.tolist()}
                samples = built.read(rows.shard[from_built], rows.sample_id[from_built])
                read.update((row, (sample, int(rows.index[row]))) for row, sample in zip(from_built.tolist(), samples))
                part.samples = [read[row][0] for row in mine.tolist()]
                part.epochs = [read[row][1] for row in mine.tolist()]
                part.cursors = lanes.cursor_rows(rows.lane[raw])
                step += 1
                yield part
        finally:
            built.close()

    def row_columns(self, sample_ids: np.ndarray) -> dict[str, np.ndarray]:
        """Each row's `stream`: its index in the mixture."""
        return {"stream": self.order.stream_of_ids(sample_ids)}


def _weights(record: MixtureRecord) -> list[tuple[str, Any]]:
    """(identity, weight spec) per stream: what a record's order depends on besides its anchor."""
    return [(s.identity, weight_spec(s.weight)) for s in record.streams]
