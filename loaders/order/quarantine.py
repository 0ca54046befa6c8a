"""Quarantine: leave corrupt shards out of the order, exactly, balanced and the same on every rank.

A quarantined shard's samples are removed from the global order from an *activation point* on: the
shards of a quarantine list (`shardkit verify --quarantine-list`) from the first position of the
run, a shard found corrupt during a run (`on_corrupt="skip"`) from the position the job had consumed
when the ranks agreed on it, and from the start of every later epoch. The order itself never
changes; an `ExcludedOrder` drops the excluded positions and renumbers the rest, so partitions,
batching, padding and elastic resume work on it unchanged, every rank gets the same number of
batches, and the positions consumed before the activation point keep their meaning. The entries
`(shard, epoch, position)` are part of the loader state, so a resume rebuilds the same filter.

How the ranks agree (`on_corrupt="skip"`). A rank cannot just skip a shard it finds corrupt: the
others, whose view of the store may be fine, would keep their batches, and the ranks would disagree
on what was consumed. So the loader consumes an epoch in *segments* of one chunk of steps
(`chunk_samples / batch_size`). Before handing out a segment, every rank's main process fetches the
shards that its own positions of the segment need into the node cache (a verified read: size,
SHA-256 and decode, one re-read on a mismatch; shards already cached were verified when cached),
then the ranks all-gather what they found corrupt. The union is quarantined from the segment's first
position on, identically everywhere, and the check repeats on the re-planned segment until nothing
new is found. Only then do the readers (the rank itself or its DataLoader workers) read the
segment, bounded to it, so no reader ever meets an unverified shard. The price, paid only with
"skip": one all-gather per segment, shards fetched by the main process before its readers open them
(from the cache), and DataLoader workers restarted at every segment.

Finding the excluded positions scans the epoch's order once per epoch and quarantine change (about
`num_positions / 10^7` seconds), only when some shard is quarantined.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardkit import metrics
from shardkit.manifest import Manifest

from .epochs import ExcludedOrder, Order, excluding
from .rank_steps import IterationPlan
from ..state.loader_state import LoaderState
from ..delivery.topology import Topology, process_group_ready

logger = logging.getLogger(__name__)

_SCAN_POSITIONS = 1 << 20
# (shard index over all streams, epoch, position of that epoch's unfiltered order) it is excluded from.
Entry = tuple[int, int, int]


def original_position(order: Order, base: Order, position: int) -> int:
    """Position of `base` (the order before quarantine) where effective `position` of `order` lies (its end
    past the last)."""
    if position >= order.num_positions:
        return base.num_positions
    return int(order.original(position)) if isinstance(order, ExcludedOrder) and order is not base else position


def active_from(entries: Sequence[Entry], epoch: int) -> dict[int, int]:
    """Shard -> first unfiltered position excluded in `epoch` (entries of later epochs do not apply yet)."""
    active: dict[int, int] = {}
    for shard, since_epoch, since_position in entries:
        if since_epoch <= epoch:
            start = 0 if since_epoch < epoch else since_position
            active[shard] = min(start, active.get(shard, start))
    return active


def quarantined_positions(order: Order, shard_ends: np.ndarray, entries: Sequence[Entry], epoch: int) -> np.ndarray:
    """Positions of `order` that quarantined shards leave in `epoch`, from their activation on (one scan)."""
    active = active_from(entries, epoch)
    if not active:
        return np.zeros(0, dtype=np.int64)
    shards = np.array(sorted(active), dtype=np.int64)
    starts = np.array([active[s] for s in shards.tolist()], dtype=np.int64)
    found = []
    for lo in range(0, order.num_positions, _SCAN_POSITIONS):
        positions = np.arange(lo, min(lo + _SCAN_POSITIONS, order.num_positions), dtype=np.int64)
        shard = np.searchsorted(shard_ends, order.sample_ids(positions), side="right")
        slot = np.minimum(np.searchsorted(shards, shard), len(shards) - 1)
        found.append(positions[(shards[slot] == shard) & (positions >= starts[slot])])
    return np.concatenate(found)


def filter_order(order: Order, shard_ends: np.ndarray, entries: Sequence[Entry], epoch: int) -> Order:
    """`order` without the positions of quarantined shards from their activation on (the order itself
    when nothing applies to `epoch`)."""
    return excluding(order, quarantined_positions(order, shard_ends, entries, epoch))


def excluded_of_shard(order: Order, base: Order, shard_ends: np.ndarray, shard: int) -> int:
    """Positions of `base` (the order before quarantine) that `order` leaves out and that hold samples of `shard`."""
    if order is base or not isinstance(order, ExcludedOrder):
        return 0
    owners = np.searchsorted(shard_ends, order.base.sample_ids(order.excluded), side="right")
    return int(np.sum(owners == shard))


def resolve_quarantine_list(path: str, manifests: Sequence[Manifest], urls: Sequence[str]) -> tuple[int, ...]:
    """Shard indices (over all streams) that the quarantine list at `path` names.

    Raises:
        ValueError: the file is unreadable or names a shard (name and SHA-256) of none of the datasets.
    """
    from shardkit.verify import read_quarantine_list

    index = {}
    offset = 0
    for manifest in manifests:
        for i, shard in enumerate(manifest.shards):
            index[(shard.name, shard.sha256)] = offset + i
        offset += len(manifest.shards)
    chosen = []
    for name, sha256 in read_quarantine_list(path):
        if (name, sha256) not in index:
            raise ValueError(f"quarantine_list {path} names shard {name} (sha256 {sha256[:16]}...), which is not a "
                             f"shard of {', '.join(urls)}: a list written for another dataset or an older build")
        chosen.append(index[(name, sha256)])
    return tuple(sorted(set(chosen)))


@dataclass(frozen=True, kw_only=True)
class QuarantineSources:
    """What the quarantine needs from the dataset, as values and functions (it never holds the dataset).

    Attributes:
        order: (epoch, num_partitions, entries) -> that epoch's order without the entries' positions.
        rank_shards: (order, start, steps, plan) -> shards this rank reads in those steps, in order.
        shard_ends, shard_sizes: sample-id ends and sample counts of every shard (all streams).
        describe: shard -> (its URL, its samples, its stream's URL), for logs and metrics.
        verify: shard -> why it is corrupt, or None (fetches it into the node cache when not there).
        agreement_group: () -> the data-parallel process group the ranks agree over (None: default).
        listed: shards of the quarantine list, left out from the first position of the run.
        listed_path: the quarantine list's path (named in logs and errors).
        checking: on_corrupt="skip": check every segment before it is read.
    """

    order: Callable[[int, int, tuple[Entry, ...]], Order]
    rank_shards: Callable[..., list[int]]  # (order, *, start, steps, plan)
    shard_ends: np.ndarray
    shard_sizes: np.ndarray
    describe: Callable[[int], tuple[str, int, str]]
    verify: Callable[[int], str | None]
    agreement_group: Callable[[], Any]
    listed: tuple[int, ...] = ()
    listed_path: str | None = None
    checking: bool = False


class Quarantine:
    """The loader's quarantine entries, and the check of each segment before it is consumed.

    Args:
        sources: what it reads from the dataset (`QuarantineSources`).
    """

    def __init__(self, sources: QuarantineSources):
        self.sources = sources
        listed = sources.listed
        self.entries: tuple[Entry, ...] = tuple((int(s), 0, 0) for s in listed)
        self.checking = sources.checking
        # Why each shard left (the error when every shard did names the list or the check).
        self.reasons: dict[int, str] = {int(s): f"quarantine_list {sources.listed_path}" for s in listed}
        if listed:
            samples = int(sum(sources.shard_sizes[s] for s in listed))
            logger.warning("quarantine_list %s: leaving %d shards (%d samples) out of the order",
                           sources.listed_path, len(listed), samples)

    def state(self) -> dict[str, Any]:
        return {"quarantine": self.entries}

    def check_saved(self, saved: LoaderState) -> None:
        """Raise when a loaded state quarantines a shard the dataset does not have (before its order is built).

        Raises:
            ValueError: naming the shard and the dataset's shard count.
        """
        shards = len(self.sources.shard_sizes)
        bad = [entry for entry in saved.quarantine if not 0 <= entry[0] < shards]
        if bad:
            raise ValueError(f"cannot resume: the state quarantines shard {bad[0][0]}, but the dataset has {shards}")

    def restore(self, saved: LoaderState) -> None:
        """The entries of a loaded state; listed shards it lacks join from its position on."""
        self.check_saved(saved)
        self.entries = saved.quarantine
        known = {s for s, _, _ in self.entries}
        listed = set(self.sources.listed)
        self.reasons = {s: (f"quarantine_list {self.sources.listed_path}" if s in listed else
                            "quarantined by an earlier run (the resumed loader state)") for s in known}
        late = [s for s in self.sources.listed if s not in known]
        if late:
            self.add(late, epoch=saved.epoch, consumed=saved.samples_consumed, num_partitions=saved.num_partitions,
                     why="quarantine_list")

    def add(self, shards: Sequence[int], *, epoch: int, consumed: int, num_partitions: int, why: str) -> None:
        """Quarantine `shards` from effective position `consumed` of `epoch` on; log and count them."""
        order_of = self.sources.order
        base = order_of(epoch, num_partitions, ())
        before = order_of(epoch, num_partitions, self.entries)
        at = original_position(before, base, consumed)
        self.entries = (*self.entries, *((int(s), epoch, at) for s in shards))
        self.reasons.update((int(s), why) for s in shards)
        after = order_of(epoch, num_partitions, self.entries)
        ends = self.sources.shard_ends
        for shard in shards:
            skipped = excluded_of_shard(after, base, ends, shard) - excluded_of_shard(before, base, ends, shard)
            url, samples, stream_url = self.sources.describe(shard)
            logger.warning("quarantined shard %s (%d samples): %s; %d of its samples not yet read in epoch %d are "
                           "skipped on every rank", url, samples, why, skipped, epoch)
            metrics.shard_quarantined(stream_url, skipped)

    def refuse_if_everything_left(self, num_positions: int) -> None:
        """Raise when quarantine left no position of an epoch (instead of the loader yielding nothing).

        Raises:
            ValueError: every shard holding samples is quarantined, naming the list or the check that did it.
        """
        sizes = self.sources.shard_sizes
        holding = set(np.flatnonzero(sizes > 0).tolist())
        if num_positions or not holding or not holding <= set(self.reasons):
            return
        by_reason: dict[str, list[int]] = {}
        for shard in sorted(holding):
            reason = self.reasons[shard]
            key = reason if reason.startswith(("quarantine_list", "quarantined by")) else "on_corrupt='skip' checks"
            by_reason.setdefault(key, []).append(shard)
        first_corrupt = next((r for r in self.reasons.values() if r.startswith("corrupt")), None)
        how = "; ".join(f"{len(shards)} by {key}" for key, shards in by_reason.items())
        raise ValueError(f"every shard of the dataset ({len(holding)} shards) was quarantined, so no sample is left "
                         f"to read: {how}" + (f" (first: {first_corrupt})" if first_corrupt else "")
                         + ". Check the data (shardkit verify) or the quarantine list")

    def check(self, *, epoch: int, start: int, steps: int, plan: IterationPlan) -> None:
        """Verify the shards this rank reads in `steps` steps from `start`; agree on the corrupt ones over
        the process group and quarantine them; repeat on the re-planned segment until none is new."""
        while True:
            order = self.sources.order(epoch, plan.num_partitions, self.entries)
            shards = self.sources.rank_shards(order, start=start, steps=steps, plan=plan)
            local = [(shard, reason) for shard in shards if (reason := self.sources.verify(shard)) is not None]
            found = self._agree(local, plan.topology)
            known = {s for s, _, _ in self.entries}
            new = sorted({shard for shard, _, _ in found} - known)
            if not new:
                return
            reasons = {shard: f"corrupt on rank {rank}: {reason}" for shard, rank, reason in sorted(found, reverse=True)}
            for shard in new:
                self.add([shard], epoch=epoch, consumed=start, num_partitions=plan.num_partitions, why=reasons[shard])

    def _agree(self, local: list[tuple[int, str]], topology: Topology) -> list[tuple[int, int, str]]:
        mine = [(shard, topology.rank, reason) for shard, reason in local]
        if topology.world_size == 1:
            return mine
        import torch.distributed as dist

        if not process_group_ready():
            raise ValueError("on_corrupt='skip' with several ranks needs an initialised torch.distributed process "
                             "group: the ranks must agree on what to skip")
        everyone: list[Any] = [None] * topology.world_size
        dist.all_gather_object(everyone, mine, group=self.sources.agreement_group())
        return [item for part in everyone for item in part]
