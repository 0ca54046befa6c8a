"""Mixtures of datasets: `Stream(url, weight=...)` and the deterministic mixture order.

The mixture order is integer arithmetic, so it is exact, O(1) to resume and independent of world
size like a single dataset's order. Weights become integer quotas `m_s` per period of
`MIX_PERIOD` positions (largest remainder); inside every period the labels are interleaved
smoothly (item j of stream s sits at (j + 1/2) / m_s). Stream s's k-th item is item k of that
stream's own endless sequence of epochs (each reshuffled with the stream's epoch number), so
streams of any size can be mixed with any weights.

A `MixturePlan` generalises this to weights that change: from an anchor (the run's start, or the
position of a mid-run change, see `remix`), positions are counted continuously across epochs and cut
into pieces of constant quotas (at the steps where a `Schedule` changes); each piece interleaves from
its own start, and a stream's k continues from its count at the piece's start, so nothing a stream
gave is repeated before its epoch ends.

Tolerance: with k streams, in any run of n consecutive positions stream s appears
n * m_s / MIX_PERIOD times within +-max(1, k - 1), and |m_s / MIX_PERIOD - weight_s / sum(weights)|
<= 1 / MIX_PERIOD. (In a prefix, stream s's count is floor(tau * m_s + 1/2) for the threshold tau
of the smooth interleave, off by at most (1 - p_s) / 2 + p_s (k - 1) / 2 from its share; a run is
the difference of two prefixes.)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any

import numpy as np

from .epochs import EpochOrder, OrderConfig
from .partition import steps_in_epoch
from .schedule import Schedule

MIX_PERIOD = 4096


@dataclass(frozen=True)
class Stream:
    """One dataset of a mixture.

    Attributes:
        url: dataset prefix (any fsspec URL) holding `shardkit.json`; with `raw_text`, raw text inputs instead
            (a file, directory, glob or fsspec URL, as `StreamingDataset(inputs, tokenizer=...)` reads them).
        weight: relative share of the mixture's samples (> 0), or a `Schedule` of weights by step.
        storage_options: fsspec options for this stream (default: the dataset's).
        raw_text: the stream is raw text, tokenized and packed on the fly with the mixture's `tokenizer=`,
            `seq_len=` and `pack=` (`shardkit.loaders.sources.mixture`).
    """

    url: str
    weight: float | Schedule = 1.0
    storage_options: dict[str, Any] | None = field(default=None, repr=False, kw_only=True)
    raw_text: bool = field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url:
            raise ValueError(f"Stream url must be a non-empty string, got {self.url!r}")
        if isinstance(self.weight, Schedule):
            return
        if not (isinstance(self.weight, (int, float)) and self.weight > 0 and np.isfinite(self.weight)):
            raise ValueError(f"Stream {self.url}: weight must be a positive number or a Schedule, "
                             f"got {self.weight!r}")


def mixture_quotas(weights: Sequence[float], period: int = MIX_PERIOD) -> np.ndarray:
    """Integer positions per period for each weight (largest remainder; ties to the first stream)."""
    w = np.asarray(weights, dtype=np.float64)
    if not w.sum() > 0:
        raise ValueError(f"mixture weights {list(weights)} leave no stream with a positive weight")
    exact = w / w.sum() * period
    quotas = np.floor(exact).astype(np.int64)
    short = period - int(quotas.sum())
    order = sorted(range(len(w)), key=lambda s: (-(exact[s] - quotas[s]), s))
    for s in order[:short]:
        quotas[s] += 1
    if np.any((quotas == 0) & (w > 0)):  # a weight of exactly 0 (a schedule's pause) is meant
        s = int(np.flatnonzero((quotas == 0) & (w > 0))[0])
        raise ValueError(f"stream {s}: weight {weights[s]} is below 1/{period} of the total and would never be "
                         "sampled; raise it or drop the stream")
    return quotas


def period_labels(quotas: np.ndarray) -> np.ndarray:
    """Stream label of each position of one period, smoothly interleaved.

    Item j of stream s sits at (2j + 1) / (2 m_s); ties go to the lower stream. Float keys order
    these exactly: distinct keys differ by at least 1 / (2 MIX_PERIOD)^2, far above float precision,
    and equal rationals round to the same float.
    """
    streams = np.repeat(np.arange(len(quotas)), quotas)
    j = np.arange(len(streams)) - np.repeat(np.cumsum(quotas) - quotas, quotas)
    keys = (2 * j + 1) / (2 * quotas[streams])
    return streams[np.lexsort((streams, keys))].astype(np.int64)


@lru_cache(maxsize=64)
def _period_tables(quotas: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(labels of one period, prefix counts [MIX_PERIOD + 1, streams]) for these quotas."""
    labels = period_labels(np.asarray(quotas, dtype=np.int64))
    prefix = np.zeros((len(labels) + 1, len(quotas)), dtype=np.int64)
    prefix[np.arange(1, len(labels) + 1), labels] = 1
    return labels, np.cumsum(prefix, axis=0)


def run_counts(quotas: np.ndarray, length: int) -> np.ndarray:
    """Items of each stream in the first `length` positions of a piece with these quotas."""
    period, r = divmod(int(length), MIX_PERIOD)
    return period * quotas + _period_tables(tuple(int(q) for q in quotas))[1][r]


@dataclass(frozen=True, kw_only=True)
class MixturePlan:
    """Which stream takes each position of a mixture, from an *anchor* on (the run's start, or the
    position of the last mid-run change) as a pure function of the weights.

    From the anchor, positions are counted continuously across epochs (`offsets`); the weights
    (fixed, or `Schedule`s evaluated at loader steps) cut that count into *pieces* of constant
    quotas. Each piece interleaves its quotas from its own start, and stream s's k-th item is item
    k of that stream's endless sequence of reshuffled epochs, where k continues from the stream's
    count at the anchor (`counts`): a change never repeats what a stream already gave.

    Attributes:
        weights: per stream, a weight or a `Schedule`.
        seed_keys: per stream, the key that seeds its order (its index in the first mixture that had it,
            so a stream keeps its order when others are added or removed).
        epoch_size: positions per mixture epoch.
        anchor_epoch, anchor_position: where this plan starts.
        anchor_step: loader step at the anchor (schedules are indexed by steps from the run's start).
        counts: per stream, items taken before the anchor (default zeros).
        global_batch: positions per loader step for schedules (the first run's global batch).
        policy: the loader's partial_batches policy (how many steps an epoch holds).
    """

    weights: tuple[float | Schedule, ...]
    seed_keys: tuple[int, ...]
    epoch_size: int
    anchor_epoch: int = 0
    anchor_position: int = 0
    anchor_step: int = 0
    counts: tuple[int, ...] = ()
    global_batch: int | None = None
    policy: str = "drop"

    def __post_init__(self) -> None:
        object.__setattr__(self, "weights", tuple(self.weights))
        object.__setattr__(self, "seed_keys", tuple(int(k) for k in self.seed_keys))
        object.__setattr__(self, "counts", tuple(int(c) for c in self.counts) or (0,) * len(self.weights))
        if not len(self.weights) == len(self.seed_keys) == len(self.counts):
            raise ValueError(f"mixture plan: {len(self.weights)} weights, {len(self.seed_keys)} seed keys and "
                             f"{len(self.counts)} counts must agree")
        if self.epoch_size < 1:
            raise ValueError(f"epoch_size must be >= 1, got {self.epoch_size}")

    @property
    def has_schedule(self) -> bool:
        return any(isinstance(w, Schedule) for w in self.weights)

    # -- positions and steps ---------------------------------------------------------------------
    def offsets(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Positions counted from the anchor, continuously across epochs."""
        positions = np.asarray(positions, dtype=np.int64)
        rest = max(self.epoch_size - self.anchor_position, 0)
        if epoch < self.anchor_epoch:
            raise ValueError(f"epoch {epoch} precedes the mixture change at epoch {self.anchor_epoch}")
        if epoch > self.anchor_epoch:
            return rest + (epoch - self.anchor_epoch - 1) * self.epoch_size + positions
        offsets = positions - self.anchor_position
        # Only the pad policy's wrap reaches back before the anchor: those repeats come from after it.
        return np.where(offsets < 0, positions % max(rest, 1), offsets)

    def _steps(self) -> tuple[int, int, int]:
        """(positions per step, steps left in the anchor epoch, steps per later epoch)."""
        if self.global_batch is None:
            raise ValueError("a weight Schedule needs the global batch size (the loader pins it at its first "
                             "iteration or from the saved state)")
        batch = self.global_batch
        first = steps_in_epoch(self.epoch_size, start=min(self.anchor_position, self.epoch_size),
                               global_batch=batch, policy=self.policy)
        return batch, first, max(1, steps_in_epoch(self.epoch_size, start=0, global_batch=batch, policy=self.policy))

    def step_offset(self, step: int) -> int:
        """Offset from the anchor of loader step `step` (>= anchor_step)."""
        batch, first, per_epoch = self._steps()
        j = step - self.anchor_step
        if j < first:
            return j * batch
        epochs, j = divmod(j - first, per_epoch)
        return max(self.epoch_size - self.anchor_position, 0) + epochs * self.epoch_size + j * batch

    def step_at(self, epoch: int, position: int) -> int:
        """Loader step at `position` of `epoch` (steps are global batches, rounded up; see `Schedule`)."""
        batch = self.global_batch or 1
        if self.global_batch is None or epoch == self.anchor_epoch:
            return self.anchor_step + -(-(int(self.offsets(epoch, np.array([position]))[0])) // batch)
        _, first, per_epoch = self._steps()
        return self.anchor_step + first + (epoch - self.anchor_epoch - 1) * per_epoch + -(-position // batch)

    # -- pieces of constant quotas ---------------------------------------------------------------
    @cached_property
    def pieces(self) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
        """(start offsets, quotas, per-stream counts at each start) of the plan's constant pieces."""
        quantum = -(-MIX_PERIOD // self.global_batch) if self.has_schedule and self.global_batch else 1
        changes = sorted({s for w in self.weights if isinstance(w, Schedule) for s in w.change_steps(quantum)
                          if s > self.anchor_step})
        starts: list[int] = []
        quotas: list[np.ndarray] = []
        for step in [self.anchor_step, *changes]:
            weights = [w.applied(step, quantum) if isinstance(w, Schedule) else w for w in self.weights]
            try:
                q = mixture_quotas(weights)
            except ValueError as err:
                raise ValueError(f"mixture weights at step {step}: {err}") from None
            if quotas and np.array_equal(q, quotas[-1]):
                continue  # one longer piece: restarting the interleave would only add rounding
            starts.append(0 if step == self.anchor_step else self.step_offset(step))
            quotas.append(q)
        bases = np.zeros((len(starts), len(self.weights)), dtype=np.int64)
        bases[0] = self.counts
        for i in range(1, len(starts)):
            bases[i] = bases[i - 1] + run_counts(quotas[i - 1], starts[i] - starts[i - 1])
        return np.asarray(starts, dtype=np.int64), quotas, bases

    def items_at(self, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(stream, k) of each offset: the k-th item of that stream since its first mixture began."""
        offsets = np.asarray(offsets, dtype=np.int64)
        starts, quotas, bases = self.pieces
        piece = np.searchsorted(starts, offsets, side="right") - 1
        stream, k = np.empty_like(offsets), np.empty_like(offsets)
        for i in np.unique(piece):
            sel = piece == i
            labels, prefix = _period_tables(tuple(int(q) for q in quotas[i]))
            period, r = np.divmod(offsets[sel] - starts[i], MIX_PERIOD)
            s = labels[r]
            stream[sel], k[sel] = s, bases[i][s] + period * quotas[i][s] + prefix[r, s]
        return stream, k

    def counts_at(self, epoch: int, position: int) -> np.ndarray:
        """Items each stream gave before `position` of `epoch` (from the anchor's counts on)."""
        offset = int(self.offsets(epoch, np.array([position]))[0])
        starts, quotas, bases = self.pieces
        i = int(np.searchsorted(starts, offset, side="right") - 1)
        return bases[i] + run_counts(quotas[i], offset - starts[i])


class MixtureOrder:
    """The order of one mixture epoch, evaluated lazily.

    Args:
        stream_shard_sizes: per stream, samples per shard.
        weights: per stream, relative weight (ignored when `plan` is given).
        config: order configuration shared by the streams (each stream's seed is offset by its seed key).
        epoch: mixture epoch.
        epoch_size: positions per mixture epoch (default: total samples over all streams).
        plan: the mixture plan (default: these weights from the run's start).
    """

    def __init__(self, stream_shard_sizes: Sequence[np.ndarray], weights: Sequence[float], config: OrderConfig,
                 epoch: int, epoch_size: int | None = None, *, plan: MixturePlan | None = None):
        self.config = config
        self.epoch = epoch
        self.sizes = [np.asarray(s, dtype=np.int64) for s in stream_shard_sizes]
        self.stream_samples = np.array([int(s.sum()) for s in self.sizes], dtype=np.int64)
        if np.any(self.stream_samples == 0):
            raise ValueError(f"stream {int(np.flatnonzero(self.stream_samples == 0)[0])} has no samples")
        self.offsets = np.concatenate([[0], np.cumsum(self.stream_samples)[:-1]]).astype(np.int64)
        if plan is None:
            size = int(epoch_size if epoch_size is not None else self.stream_samples.sum())
            if size < 1:
                raise ValueError(f"epoch_size must be >= 1, got {epoch_size}")
            plan = MixturePlan(weights=tuple(weights), seed_keys=range(len(self.sizes)), epoch_size=size)
        if len(plan.weights) != len(self.sizes):
            raise ValueError(f"mixture plan for {len(plan.weights)} streams, given {len(self.sizes)}")
        self.plan = plan
        self.num_positions = plan.epoch_size
        self._orders: OrderedDict[tuple[int, int], EpochOrder] = OrderedDict()

    def __len__(self) -> int:
        return self.num_positions

    def _stream_order(self, stream: int, epoch: int) -> EpochOrder:
        key = (stream, epoch)
        order = self._orders.get(key)
        if order is None:
            seed = self.config.seed + 1_000_003 * self.plan.seed_keys[stream]
            config = OrderConfig(shuffle=self.config.shuffle, seed=seed,
                                 num_partitions=self.config.num_partitions, block_size=self.config.block_size,
                                 shuffle_window=self.config.shuffle_window)
            order = EpochOrder(self.sizes[stream], config, epoch)
            self._orders[key] = order
            if len(self._orders) > 2 * len(self.sizes) + 2:
                self._orders.popitem(last=False)
        return order

    def stream_items(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(stream, k) of each position: the k-th item of that stream since the mixture began."""
        return self.plan.items_at(self.plan.offsets(self.epoch, positions))
    def _evaluate(self, positions: np.ndarray, what: str) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        stream, k = self.stream_items(positions.reshape(-1))
        stream_epoch, local = np.divmod(k, self.stream_samples[stream])
        out = np.empty_like(k)
        key = stream * (int(stream_epoch.max(initial=0)) + 1) + stream_epoch
        for value in np.unique(key):
            sel = np.flatnonzero(key == value)
            s, e = int(stream[sel[0]]), int(stream_epoch[sel[0]])
            order = self._stream_order(s, e)
            if what == "ids":
                out[sel] = order.sample_ids(local[sel]) + self.offsets[s]
            else:
                out[sel] = order.partition_of(local[sel])
        return out.reshape(positions.shape)

    def sample_ids(self, positions: np.ndarray) -> np.ndarray:
        """Global sample ids: stream s's ids are offset by the samples of the streams before it."""
        return self._evaluate(positions, "ids")

    def partition_of(self, positions: np.ndarray) -> np.ndarray:
        return self._evaluate(positions, "partitions")
