"""`RawTextFeed`: the loader's side of raw text (`StreamingDataLoader` over a raw-text source), exact and elastic.

The state is global like a built dataset's (`shardkit.loaders.state.loader_state`): `samples_consumed` (global positions
handed to the training loop) and, under `raw_text`, one cursor per lane read so far. A rank knows only the
cursors of the lanes it read, so `state_dict()` gathers them from every rank (`all_gather_object` over the
dataset's process group) and keeps the furthest cursor of each lane: every rank returns the same dict, and a
job resumed with another world size, batch size or number of workers starts each lane at its cursor.
Raw text has no epoch end that all ranks could agree on (each lane runs its own lane epochs), so an
iteration is endless: the training loop decides when to stop. Under `on_corrupt="skip"` the ranks agree on each
step's unreadable units before it is handed out (`shardkit.loaders.sources.raw.unreadable`); the state holds their cuts
under `raw_text.unreadable`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

from shardkit import metrics

from ...delivery.batch_counts import counted_batches
from ...delivery.closing import closed_at_exit
from .batches import CURSORS_KEY, DRY_KEY, UNREADABLE_KEY
from .iteration import RawIteration
from ...order.lanes import merge_cursors
from .corpus import CURSOR_FIELDS, OLD_CURSOR_FIELDS, LaneCursor, cursor_rows
from .units import few_lanes_advice
from .dry_lanes import DryLane, agrees_on_dry_lanes, dry_from_rows, dry_rows, log_dry, newly_dry
from .unreadable import UnitCuts, agree, log_skipped, settle
from .worker_start import WorkerStart
from ...source import Feed
from ...state.envelope import decode, encode
from .agreement import check_every_rank_calls
from ...state.loader_state import LoaderState
from ...delivery.tensors import batch_to_tensors
from ...delivery.topology import Topology, process_group_ready

logger = logging.getLogger(__name__)
_WARNED_FEW_LANES: set[tuple[str, int]] = set()  # (corpus, readers) warned about in this process


def warn_few_lanes(corpus: Any, *, readers: int) -> None:
    """Warn once per corpus and number of readers when some readers would get no lane."""
    advice = few_lanes_advice(corpus.units, corpus.files, corpus.num_lanes, readers=readers,
                              lanes_asked=corpus.settings.lanes)
    if advice is not None and (corpus.fingerprint, readers) not in _WARNED_FEW_LANES:
        _WARNED_FEW_LANES.add((corpus.fingerprint, readers))
        logger.warning("%s", advice)


class RawTextFeed(Feed):
    """The loader's side of a raw-text source (`RawTextSource.feed`): endless steps and the lanes' cursors.

    Args:
        source: the `RawTextSource` (or a mixture's).
        loader: the `StreamingDataLoader` that drives it (its options are checked; the feed keeps no reference).
        batch_size: samples per rank per step.
    """

    def __init__(self, source: Any, loader: Any, batch_size: int | None):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.source = source
        # Persistent workers are told where each later iteration starts (`worker_start`); they are kept while their
        # copies of the source still hold its mixture, cuts and dry lanes (`_workers_in_sync`), else started again.
        self._worker_start = WorkerStart(source.num_lanes) if loader.persistent_workers and loader.num_workers \
            else None
        self._workers_in_sync = False
        self._workers_hold: tuple[UnitCuts, dict[int, int]] | None = None  # the cuts and dry lanes their copies hold
        self.samples_per_rank = batch_size
        self._topology: Topology | None = None
        self._consumed = 0
        self._cursors: dict[int, tuple[int, ...]] = {}  # lane -> cursor after the last batch handed out
        self._cuts = UnitCuts()  # the unreadable units skipped (agreed by every rank)
        self._dry: dict[int, int] = {}  # lane -> its samples in all: the lanes that ran dry (agreed by every rank)
        self._published: Counter = Counter()  # the rejections already added to the metric

    def _resolve(self) -> Topology:
        self._topology = self.source.topology()
        return self._topology

    def length(self) -> int:
        raise TypeError("a raw-text StreamingDataLoader has no length: its lanes go on epoch after epoch (stop "
                        "after a number of steps: shardkit train --steps)")

    @property
    def epoch(self) -> int:
        """Always 0: raw text counts epochs per lane (each batch's `lane_epoch`)."""
        return 0

    def _publish_rejections(self) -> None:
        """Add the rejections counted since the last call to `shardkit_loader_documents_rejected_total`."""
        now = self.source.rejected
        for reason, count in now.items():
            if count > self._published[reason]:
                metrics.inc("shardkit_loader_documents_rejected_total", count - self._published[reason],
                            reason=reason)
        self._published = Counter(now)

    def counters(self) -> dict[str, int]:
        """`skipped_units`: unreadable units skipped so far (`on_corrupt="skip"`); `dry_lanes`: lanes left out of
        the order since they ran dry (`sources.raw.dry_lanes`); the same on every rank."""
        return {"skipped_units": len(self._cuts), "dry_lanes": len(self._dry)}

    @closed_at_exit  # its `finally` publishes counts: before the interpreter's teardown empties the modules
    def batches(self, loader: Any) -> Iterator[dict[str, torch.Tensor]]:
        topology = self._resolve()
        self.source.check_corpus_agreed()
        global_batch = self.samples_per_rank * topology.world_size
        if self.source.few_lanes_idle_readers:
            warn_few_lanes(self.source.corpus, readers=topology.world_size * max(1, loader.num_workers))

        def prepare(arrays: dict[str, Any]) -> dict[str, torch.Tensor]:
            cursors = arrays.pop(CURSORS_KEY)
            self._consumed += global_batch
            self._cursors.update((row[0], tuple(row[1:])) for row in cursors.tolist())
            return batch_to_tensors(arrays, self.source.token_dtype)

        lanes = self.source.num_lanes
        waiting_for = (f"re-reading {len(self._cursors)} raw-text lanes up to their saved cursors" if self._cursors
                       else f"tokenizing and packing the first units of {lanes} raw-text lanes")
        yield from counted_batches(self._agreed_batches(loader, topology), prepare, waiting_for=waiting_for,
                                   pin=loader.pin_batches and torch.cuda.is_available())

    def _agreed_batches(self, loader: Any, topology: Topology) -> Iterator[dict[str, Any]]:
        """The numpy batches from where the loader stands. A step's unreadable units (under "skip") and lanes found
        dry (`sources.raw.dry_lanes`) are agreed over the ranks before it is handed out; when some rank did not
        read the step with exactly the agreed cuts, or a lane ran dry, every rank starts its iteration again at
        that step (from its lanes' cursors) and reads it with them."""
        while True:
            iteration = self.iteration_here(topology)
            self.source.begin(iteration)
            batches = self._numpy_batches(loader, iteration)
            counted = Counter(self.source.rejected)  # before the step: a step read again counts its rejections once
            try:
                for batch in batches:
                    if self._read_again(batch.pop(UNREADABLE_KEY), batch.pop(DRY_KEY), topology):
                        self.source.rejected = counted
                        break
                    self._publish_rejections()  # the step is handed out: its rejections are counted for good
                    yield batch
                    counted = Counter(self.source.rejected)
                else:
                    return
            finally:
                batches.close()

    def _read_again(self, found: list[Any], dry: list[DryLane], topology: Topology) -> bool:
        """Agree on a step's findings where the step is agreed (adding the cuts and dry lanes to the loader's);
        whether every rank must read the step again.

        Raises:
            ValueError: a lane ran dry in a step the ranks cannot agree on (`LaneRanDry`'s message).
        """
        if topology.world_size == 1 and not found and not dry:  # alone, nothing to agree on: the common case
            return False
        skipping = self.source.on_corrupt == "skip"
        group = self.source.agreement_group
        grouped = topology.world_size == 1 or process_group_ready()
        if not agrees_on_dry_lanes(skipping=skipping, world_size=topology.world_size, grouped=grouped,
                                   step_start=self._consumed, num_lanes=self.source.num_lanes, dry=self._dry):
            if dry:
                raise ValueError(f"{dry[0].message} (the ranks cannot agree on leaving it out here: "
                                 f"{_why_not_agreed(grouped)})")
            return False
        everyone = agree((found, dry), world_size=topology.world_size, group=group())
        cuts, again = settle([part[0] for part in everyone], lane_counts=self.source.lane_counts(self._consumed,
                                                                                                 self._dry))
        if cuts:
            self._cuts = self._cuts.adding([c.cut for c in cuts])
            log_skipped(cuts, self.source.unit_url)
        if again:  # the dry lanes a reader found with other cuts: found again with the agreed ones
            return True
        newly = newly_dry([part[1] for part in everyone], self._dry)
        self._dry.update((item.lane, item.samples) for item in newly)
        log_dry(newly, num_lanes=self.source.num_lanes, dry=self._dry)
        return bool(newly)

    def iteration_here(self, topology: Topology) -> RawIteration:
        """An iteration that starts where the loader stands (a data service's worker reads a step's parts from
        it: `sources.service.parts`)."""
        return RawIteration(start=self._consumed, batch_size=self.samples_per_rank, topology=topology,
                            cursors=dict(self._cursors), cuts=self._cuts, dry=dict(self._dry),
                            worker_start=self._worker_start)

    def _numpy_batches(self, loader: Any, iteration: RawIteration) -> Iterator[dict[str, Any]]:
        if loader.num_workers == 0:  # read the dataset directly (the DataLoader machinery only adds overhead)
            yield from iter(loader.dataset)
            return
        held = (iteration.cuts, iteration.dry)
        if loader.has_worker_iterator() and not (self._workers_in_sync and held == self._workers_hold):
            loader.stop_workers()  # their copies hold another mixture (a loaded state), other cuts or dry lanes
        if self._worker_start is not None:
            self._worker_start.write(iteration)  # before the workers begin it (persistent ones: as they resume)
        self._workers_hold, self._workers_in_sync = held, True
        # The DataLoader hands out worker outputs round robin in worker order: one part of each step per worker.
        parts = loader.worker_batches()
        try:
            while True:
                yield self.source.assemble([next(parts) for _ in range(loader.num_workers)])
        except GeneratorExit:  # the training loop stopped the iteration
            raise
        except BaseException:
            self._workers_in_sync = False  # a failed iteration's workers are not resumed
            raise
        finally:
            # Persistent workers stay: they read ahead only as far as the DataLoader's outstanding requests. Others
            # would read ahead endlessly: stop them with the iteration.
            if self._worker_start is None:
                parts._shutdown_workers()

    # -- state ---------------------------------------------------------------------------------
    def _state(self) -> LoaderState:
        topology = self._topology or self._resolve()
        return LoaderState(epoch=0, samples_consumed=self._consumed, num_samples=0, block_size=None,
                           shuffle_window=0, partial_batches="drop", epoch_size=None,
                           global_batch_size=self.samples_per_rank * topology.world_size,
                           world_size=topology.world_size, **self.source.order_values(),
                           identity_parts=self.source.identity_parts(),
                           raw_text={"cursors": cursor_rows(self._cursors), "unreadable": self._cuts.rows(),
                                     **({"dry_lanes": dry_rows(self._dry)} if self._dry else {}),
                                     **self.source.raw_state()})

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's state: the cursors of the lanes this rank read (merge every rank's with
        `merge_raw_states`; `state_dict()` does it through the process group)."""
        return self._state().to_dict()

    def state_dict(self) -> dict[str, Any]:
        """The global resume state, identical on every rank. With several ranks every rank must call it (it
        gathers the lanes' cursors from all ranks).

        Raises:
            ValueError: several ranks but no initialised process group to gather over.
        """
        return self.global_state(self.local_state_dict())

    def global_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The global state of every rank's `local_state_dict()` taken at the same step (gathered)."""
        return gathered_state(state, self.source.agreement_group)

    def load_state_dict(self, state: dict[str, Any], *, allow_mixture_change: bool = False) -> None:
        """Resume from `state_dict()` (saved with any world size, batch size or workers).

        Args:
            state: the saved state.
            allow_mixture_change: a mixture with raw-text streams continues from the saved position with this
                dataset's streams and weights when they differ from the saved ones (see `sources.mixture`).

        Raises:
            ValueError: the state is malformed, not a raw-text state, or belongs to other inputs or settings.
        """
        saved = LoaderState.from_dict(state)
        if saved.raw_text is None:
            raise ValueError("cannot resume: the saved loader state is a built dataset's, not raw text's")
        if saved.legacy_identities:
            saved = self.source.upgrade_legacy(saved)
        current = self._state()
        saved_kind, kind = (_kind(state.raw_text) for state in (saved, current))
        if saved_kind != kind:
            raise ValueError(f"cannot resume: the saved loader state is {saved_kind}'s, this loader reads {kind}")
        # A mixture's "dataset" and lanes follow its streams and weights, which its plan checks one by one (a
        # mixture saved before it kept a record cannot change: those fields decide).
        changeable = kind != _kind({}) and "mixture" in saved.raw_text
        differences = saved.differences(current, ignore=("dataset", "num_partitions") if changeable else ())
        if differences:
            if saved.identity_parts is not None and current.identity_parts is not None:  # name the part that differs
                differences = [d for d in differences if not d.startswith("dataset:")] + [
                    f"{name}: saved {saved.identity_parts.get(name)!r}, now {value!r}"
                    for name, value in current.identity_parts.items() if saved.identity_parts.get(name) != value]
            raise ValueError("cannot resume: the saved loader state belongs to other inputs or settings ("
                             + "; ".join(differences) + ")")
        cursors = saved_cursors(saved.raw_text)
        cuts = UnitCuts.from_rows(saved.raw_text.get("unreadable", ()))  # a state from before skipping had none
        cursors, cuts = self.source.restore(saved.raw_text, cursors, cuts, samples_consumed=saved.samples_consumed,
                                          allow_mixture_change=allow_mixture_change)
        dry = dry_from_rows(saved.raw_text.get("dry_lanes", ()), self.source.num_lanes)
        check_cursors(cursors, self.source, saved.samples_consumed, dry)
        self._consumed, self._cursors, self._cuts, self._dry = saved.samples_consumed, cursors, cuts, dry
        self._workers_in_sync = False  # the source may have changed (a mixture's record): new workers copy it


def saved_cursors(raw_text: dict[str, Any]) -> dict[int, tuple[int, ...]]:
    """lane -> cursor from a state's `raw_text`: rows of [lane, samples, epoch, unit, segment, within, document,
    token] (`sources.raw.corpus.LaneCursor`), or of the first six, as states saved before the restart point
    (document, token) was kept hold them: those resume from their segment's start (document and token 0).

    Raises:
        ValueError: the cursors are not such rows.
    """
    try:
        rows = [[int(v) for v in row] for row in raw_text["cursors"]]
    except (KeyError, TypeError, ValueError):
        rows = None
    if rows is None or any(len(row) not in (1 + CURSOR_FIELDS, 1 + OLD_CURSOR_FIELDS) for row in rows):
        raise ValueError("loader state: raw_text.cursors must be a list of [lane, samples, epoch, unit, segment, "
                         "within, document, token] (a state saved by an older loader cannot be resumed)")
    padding = (0,) * (CURSOR_FIELDS - OLD_CURSOR_FIELDS)
    return {row[0]: tuple(row[1:]) + (padding if len(row) == 1 + OLD_CURSOR_FIELDS else ()) for row in rows}


def check_cursors(cursors: dict[int, tuple[int, ...]], source: Any, samples_consumed: int,
                  dry: dict[int, int] | None = None) -> None:
    """Refuse cursors this corpus cannot have written at `samples_consumed` (a damaged or edited state): a lane it
    does not have, a sample count other than the lane's share of the consumed positions, a unit beyond the lane's.

    Raises:
        ValueError: naming the lane and the field.
    """
    counts = source.lane_counts(samples_consumed, dry or {})
    for lane, row in sorted(cursors.items()):
        cursor = LaneCursor(*row)
        samples, unit, within = cursor.samples, cursor.unit, cursor.within
        where = f"cannot resume: the loader state's cursor of lane {lane}"
        if lane >= len(counts):
            raise ValueError(f"{where}: this corpus has {len(counts)} lanes (a damaged or edited state)")
        if samples != counts[lane]:
            raise ValueError(f"{where} has delivered {samples} samples, but {samples_consumed} consumed positions "
                             f"hold {int(counts[lane])} of that lane (a damaged or edited state)")
        if unit >= source.lane_unit_count(lane) or within > samples:
            raise ValueError(f"{where} stands at unit {unit}, sample {within} of its segment, beyond the lane's "
                             f"{source.lane_unit_count(lane)} units or its {samples} samples (a damaged or edited "
                             "state)")


def _why_not_agreed(grouped: bool) -> str:
    if not grouped:
        return "several ranks without an initialised torch.distributed process group"
    return "it ran dry after its first lane epoch under on_corrupt='raise': resume with on_corrupt='skip'"


def _kind(raw_text: dict[str, Any]) -> str:
    """What a state's `raw_text` belongs to (a mixture records its streams)."""
    return "a mixture with raw-text streams" if "streams" in raw_text else "a single raw-text dataset"


def gathered_state(state: dict[str, Any], group_of: Callable[[], Any], *, what: str = "a raw-text loader"
                   ) -> dict[str, Any]:
    """The global state of this rank's local raw-text `state` and every other rank's, gathered over the group
    `group_of()` answers (every rank must call it: `agreement.check_every_rank_calls`).

    Raises:
        ValueError: several ranks but no initialised process group, or a rank that does not call it.
    """
    world_size = decode(state)["world_size"]
    if world_size == 1:
        return state
    import torch.distributed as dist

    if not process_group_ready():
        raise ValueError(f"state_dict() of {what} on {world_size} ranks gathers every rank's lane cursors: "
                         "initialise torch.distributed first (or merge the ranks' local_state_dict() with "
                         "shardkit.loaders.sources.raw.feed.merge_raw_states)")
    group = group_of()
    check_every_rank_calls(group, world_size=world_size)
    states: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(states, state, group=group)
    return merge_raw_states(states)


def merge_raw_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One global state from every rank's `local_state_dict()` (the furthest cursor of each lane).

    Raises:
        ValueError: the states do not stand at the same position.
    """
    flats = [decode(s) for s in states]
    if len({s["samples_consumed"] for s in flats}) != 1:
        raise ValueError("raw-text states of different positions cannot be merged: "
                         f"{sorted({s['samples_consumed'] for s in flats})}")
    cursors = merge_cursors(*(saved_cursors(s["raw_text"]) for s in flats))
    # The cuts of unreadable units are agreed, the same in every rank's state.
    return encode({**flats[0], "raw_text": {**flats[0]["raw_text"], "cursors": cursor_rows(cursors)}})
