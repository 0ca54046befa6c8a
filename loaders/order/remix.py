"""Mid-run mixture changes: the mixture record of the loader state, and the plan after a change.

A mixture's order is a `MixturePlan`: weights (or schedules) applied from an anchor on, with each
stream's count of items taken before it. A change of weights, an added or a removed stream starts a
new plan whose anchor is the saved position and whose counts are what each stream gave under the
old plan up to there (pure arithmetic on the old plan: nothing is read). A stream continues its own
sequence of reshuffled epochs from its count, so no sample of its current epoch is repeated; an added
stream starts at its first epoch; a removed stream keeps its count (and its seed key) in `retired`,
so adding it back later continues it too.

Streams are identified by the fingerprint of their data (shard names, sizes, hashes), not their URL,
so a dataset moved to another bucket is the same stream. The record is JSON-able and small: a few
numbers per stream and one entry per change (step, position, old and new weights).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from .mixing import MixturePlan
from .schedule import Schedule, weight_from_spec, weight_spec
from ..state.loader_state import LoaderState

logger = logging.getLogger(__name__)

RECORD_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class StreamEntry:
    """One stream of the record: its data identity, the key seeding its order, its weight and, for a
    removed stream, how many items it gave."""

    url: str
    identity: str  # fingerprint of its data, with '#n' for the n-th repeat of the same data in one mixture
    seed_key: int
    weight: float | Schedule = 1.0
    count: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "identity": self.identity, "seed_key": self.seed_key,
                "weight": weight_spec(self.weight), "count": self.count}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StreamEntry:
        return cls(url=str(data["url"]), identity=str(data["identity"]), seed_key=int(data["seed_key"]),
                   weight=weight_from_spec(data["weight"]), count=int(data.get("count", 0)))


@dataclass(frozen=True, kw_only=True)
class MixtureRecord:
    """The mixture part of the loader state (see the module docstring)."""

    streams: tuple[StreamEntry, ...]
    epoch_size: int
    policy: str
    anchor_epoch: int = 0
    anchor_position: int = 0
    anchor_step: int = 0
    counts: tuple[int, ...] = ()
    global_batch: int | None = None
    retired: tuple[StreamEntry, ...] = ()
    changes: tuple[dict[str, Any], ...] = ()

    @cached_property
    def plan(self) -> MixturePlan:
        return MixturePlan(weights=tuple(s.weight for s in self.streams),
                           seed_keys=tuple(s.seed_key for s in self.streams), epoch_size=self.epoch_size,
                           anchor_epoch=self.anchor_epoch, anchor_position=self.anchor_position,
                           anchor_step=self.anchor_step, counts=self.counts, global_batch=self.global_batch,
                           policy=self.policy)

    def pinned(self, global_batch: int) -> MixtureRecord:
        """This record with the global batch that converts schedule steps to positions (set once)."""
        return self if self.global_batch is not None else replace(self, global_batch=int(global_batch))

    def to_dict(self) -> dict[str, Any]:
        return {"version": RECORD_VERSION, "streams": [s.to_dict() for s in self.streams],
                "epoch_size": self.epoch_size, "policy": self.policy,
                "anchor": {"epoch": self.anchor_epoch, "position": self.anchor_position, "step": self.anchor_step,
                           "counts": list(self.plan.counts)},
                "global_batch": self.global_batch, "retired": [s.to_dict() for s in self.retired],
                "changes": [dict(c) for c in self.changes]}

    @classmethod
    def from_dict(cls, data: Any) -> MixtureRecord:
        if not isinstance(data, dict) or data.get("version") != RECORD_VERSION:
            raise ValueError(f"loader state: mixture record of version "
                             f"{data.get('version') if isinstance(data, dict) else None!r} is not supported "
                             f"(this shardkit reads version {RECORD_VERSION})")
        try:
            anchor = data["anchor"]
            return cls(streams=tuple(StreamEntry.from_dict(s) for s in data["streams"]),
                       epoch_size=int(data["epoch_size"]), policy=str(data["policy"]),
                       anchor_epoch=int(anchor["epoch"]), anchor_position=int(anchor["position"]),
                       anchor_step=int(anchor["step"]), counts=tuple(int(c) for c in anchor["counts"]),
                       global_batch=None if data.get("global_batch") is None else int(data["global_batch"]),
                       retired=tuple(StreamEntry.from_dict(s) for s in data.get("retired", [])),
                       changes=tuple(dict(c) for c in data.get("changes", [])))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"loader state: damaged mixture record ({err!r})") from None


def identities(fingerprints: list[str]) -> list[str]:
    """Stream identities: the data's fingerprint, '#n' marking the n-th repeat of the same data."""
    seen: dict[str, int] = {}
    out = []
    for fp in fingerprints:
        out.append(fp if fp not in seen else f"{fp}#{seen[fp]}")
        seen[fp] = seen.get(fp, 0) + 1
    return out


@dataclass(frozen=True, kw_only=True)
class MixtureStreams:
    """A dataset's streams as the record needs them (in the dataset's order)."""

    urls: list[str]
    fingerprints: list[str]  # each stream's data fingerprint (as a dataset of its own)
    weights: list[float | Schedule]
    epoch_size: int
    policy: str


def fresh_record(streams: MixtureStreams) -> MixtureRecord:
    """The record of a mixture used from the run's start (seed keys = list positions, as ever)."""
    entries = tuple(StreamEntry(url=u, identity=i, seed_key=k, weight=w)
                    for k, (u, i, w) in enumerate(zip(streams.urls, identities(streams.fingerprints), streams.weights)))
    return MixtureRecord(streams=entries, epoch_size=streams.epoch_size, policy=streams.policy)


def resumed_record(saved: LoaderState, streams: MixtureStreams, *, changed: bool) -> MixtureRecord | None:
    """The record a resume from `saved` continues with: the saved one, or (`changed`) a new plan from
    the saved position with `streams`.

    Raises:
        ValueError: the saved record does not describe `streams` although nothing changed (a damaged
            state), or the change cannot be made exactly (mid token window, unknown consumption).
    """
    record = MixtureRecord.from_dict(saved.mixture) if saved.mixture is not None else None
    if not changed:
        if record is not None and ([(s.identity, s.weight) for s in record.streams]
                                   != [(s.identity, s.weight) for s in fresh_record(streams).streams]):
            raise ValueError("cannot resume: the loader state's mixture record does not describe this mixture's "
                             "streams and weights (a damaged or edited state)")
        return record
    if saved.window_segments:
        raise ValueError("cannot change the mixture in the middle of a token-budget window: resume once with "
                         "the saved mixture until the window ends (the state's window_segments is empty)")
    if record is None:  # a single dataset's state (or one saved before mixtures kept a record)
        if saved.dataset not in streams.fingerprints:
            raise ValueError("cannot change the mixture: the saved loader state records no mixture and its "
                             f"dataset ({saved.dataset}) is none of the current streams, so what each stream "
                             "consumed is unknown; resume with the saved streams and weights first")
        # A single dataset's order is a one-stream mixture's: seed key 0, an epoch of all its samples.
        record = MixtureRecord(streams=(StreamEntry(url="(the saved dataset)", identity=saved.dataset, seed_key=0),),
                               epoch_size=saved.num_samples, policy=saved.partial_batches)
    return changed_record(record.pinned(saved.global_batch_size), epoch=saved.epoch,
                          position=saved.samples_consumed, streams=streams)


def changed_record(old: MixtureRecord, *, epoch: int, position: int, streams: MixtureStreams) -> MixtureRecord:
    """The record continuing `old` at `position` of `epoch` with new streams and weights.

    Each stream known to `old` (current or retired, by data identity) keeps its seed key and continues
    from its count at the change; a new stream gets a fresh seed key and starts at 0.
    """
    counts = old.plan.counts_at(epoch, position)
    step = old.plan.step_at(epoch, position)
    known = {s.identity: replace(s, count=int(c)) for s, c in zip(old.streams, counts)}
    known.update({s.identity: s for s in old.retired if s.identity not in known})
    next_key = max([s.seed_key for s in known.values()], default=-1) + 1
    entries = []
    for url, identity, weight in zip(streams.urls, identities(streams.fingerprints), streams.weights):
        before = known.get(identity)
        if before is None:
            before = StreamEntry(url=url, identity=identity, seed_key=next_key)
            next_key += 1
        entries.append(replace(before, url=url, weight=weight))
    kept = {s.identity for s in entries}
    retired = tuple(s for s in known.values() if s.identity not in kept)
    change = {"step": step, "epoch": epoch, "position": position,
              "old": [[s.url, weight_spec(s.weight)] for s in old.streams],
              "new": [[s.url, weight_spec(s.weight)] for s in entries]}
    return MixtureRecord(streams=tuple(replace(s, count=0) for s in entries), epoch_size=streams.epoch_size,
                         policy=old.policy, anchor_epoch=epoch, anchor_position=position, anchor_step=step,
                         counts=tuple(s.count for s in entries), global_batch=old.global_batch, retired=retired,
                         changes=(*old.changes, change))


class Mixture:
    """The mixing stage: the mixture's record and its part of the loader state (`state()` / `restore(saved)`).

    Args:
        streams: () -> the dataset's streams as the record needs them (called when first needed: it
            fingerprints every stream).
        mixed: several streams (a single dataset has no record until its mixture changes).
    """

    def __init__(self, streams: Callable[[], MixtureStreams], *, mixed: bool):
        self._streams, self._mixed = streams, mixed
        self._record: MixtureRecord | None = None

    @property
    def record(self) -> MixtureRecord | None:
        """The record (None for a single dataset that never changed its mixture)."""
        if self._record is None and self._mixed:
            self._record = fresh_record(self._streams())
        return self._record

    def pin(self, global_batch: int) -> None:
        """Fix the positions per step of weight schedules: the first run's global batch, kept on resume."""
        record = self.record
        if record is not None:
            self._record = record.pinned(global_batch)

    def state(self) -> dict[str, Any]:
        record = self.record
        return {"mixture": record.to_dict() if record is not None else None}

    def restore(self, saved: LoaderState, *, changed: bool = False) -> None:
        """Adopt the saved record, or (`changed`: the streams or weights differ) continue it with this
        dataset's streams from the saved position (see `resumed_record` for what it raises)."""
        self._record = resumed_record(saved, self._streams(), changed=changed)
        if changed:
            change = self._record.changes[-1]
            logger.info("mixture changed at step %d (epoch %d, position %d): %s -> %s", change["step"], saved.epoch,
                        saved.samples_consumed, change["old"], change["new"])
