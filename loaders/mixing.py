"""Mixtures of datasets: `Stream(url, weight=...)` and the deterministic mixture order.

The mixture order is integer arithmetic, so it is exact, O(1) to resume and independent of world
size like a single dataset's order. Weights become integer quotas `m_s` per period of
`MIX_PERIOD` positions (largest remainder); inside every period the labels are interleaved
smoothly (item j of stream s sits at (j + 1/2) / m_s). Stream s's k-th item is item k of that
stream's own endless sequence of epochs (each reshuffled with the stream's epoch number), so
streams of any size can be mixed with any weights.

Tolerance: in any run of n consecutive positions, stream s appears n * m_s / MIX_PERIOD times
within +-2, and |m_s / MIX_PERIOD - weight_s / sum(weights)| <= 1 / MIX_PERIOD.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

from shardkit.loaders.order import EpochOrder, OrderConfig

MIX_PERIOD = 4096


@dataclass(frozen=True)
class Stream:
    """One dataset of a mixture.

    Attributes:
        url: dataset prefix (any fsspec URL) holding `shardkit.json`.
        weight: relative share of the mixture's samples (> 0).
        storage_options: fsspec options for this stream (default: the dataset's).
    """

    url: str
    weight: float = 1.0
    storage_options: dict[str, Any] | None = field(default=None, repr=False, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url:
            raise ValueError(f"Stream url must be a non-empty string, got {self.url!r}")
        if not (isinstance(self.weight, (int, float)) and self.weight > 0 and np.isfinite(self.weight)):
            raise ValueError(f"Stream {self.url}: weight must be a positive number, got {self.weight!r}")


def mixture_quotas(weights: Sequence[float], period: int = MIX_PERIOD) -> np.ndarray:
    """Integer positions per period for each weight (largest remainder; ties to the first stream)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * period
    quotas = np.floor(exact).astype(np.int64)
    short = period - int(quotas.sum())
    order = sorted(range(len(w)), key=lambda s: (-(exact[s] - quotas[s]), s))
    for s in order[:short]:
        quotas[s] += 1
    if np.any(quotas == 0):
        s = int(np.flatnonzero(quotas == 0)[0])
        raise ValueError(f"stream {s}: weight {weights[s]} is below 1/{period} of the total and would never be "
                         "sampled; raise it or drop the stream")
    return quotas


def period_labels(quotas: np.ndarray) -> np.ndarray:
    """Stream label of each position of one period, smoothly interleaved (exact rational keys)."""
    items = [(Fraction(2 * j + 1, 2 * int(m)), s) for s, m in enumerate(quotas) for j in range(int(m))]
    items.sort()
    return np.array([s for _, s in items], dtype=np.int64)


class MixtureOrder:
    """The order of one mixture epoch, evaluated lazily.

    Args:
        stream_shard_sizes: per stream, samples per shard.
        weights: per stream, relative weight.
        config: order configuration shared by the streams (each stream's seed is offset by its index).
        epoch: mixture epoch.
        epoch_size: positions per mixture epoch (default: total samples over all streams).
    """

    def __init__(self, stream_shard_sizes: Sequence[np.ndarray], weights: Sequence[float], config: OrderConfig,
                 epoch: int, epoch_size: int | None = None):
        self.config = config
        self.epoch = epoch
        self.sizes = [np.asarray(s, dtype=np.int64) for s in stream_shard_sizes]
        self.stream_samples = np.array([int(s.sum()) for s in self.sizes], dtype=np.int64)
        if np.any(self.stream_samples == 0):
            raise ValueError(f"stream {int(np.flatnonzero(self.stream_samples == 0)[0])} has no samples")
        self.offsets = np.concatenate([[0], np.cumsum(self.stream_samples)[:-1]]).astype(np.int64)
        self.num_positions = int(epoch_size if epoch_size is not None else self.stream_samples.sum())
        if self.num_positions < 1:
            raise ValueError(f"epoch_size must be >= 1, got {epoch_size}")
        self.quotas = mixture_quotas(weights)
        self.labels = period_labels(self.quotas)
        prefix = np.zeros((len(self.labels) + 1, len(self.sizes)), dtype=np.int64)
        prefix[np.arange(1, len(self.labels) + 1), self.labels] = 1
        self.prefix = np.cumsum(prefix, axis=0)
        self._orders: OrderedDict[tuple[int, int], EpochOrder] = OrderedDict()

    def __len__(self) -> int:
        return self.num_positions

    def _stream_order(self, stream: int, epoch: int) -> EpochOrder:
        key = (stream, epoch)
        order = self._orders.get(key)
        if order is None:
            config = OrderConfig(shuffle=self.config.shuffle, seed=self.config.seed + 1_000_003 * stream,
                                 num_partitions=self.config.num_partitions, block_size=self.config.block_size,
                                 shuffle_window=self.config.shuffle_window)
            order = EpochOrder(self.sizes[stream], config, epoch)
            self._orders[key] = order
            if len(self._orders) > 2 * len(self.sizes) + 2:
                self._orders.popitem(last=False)
        return order

    def stream_items(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(stream, k) of each position: the k-th item of that stream since the mixture began."""
        g = np.asarray(positions, dtype=np.int64) + self.epoch * self.num_positions
        period, r = np.divmod(g, len(self.labels))
        stream = self.labels[r]
        return stream, period * self.quotas[stream] + self.prefix[r, stream]

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
