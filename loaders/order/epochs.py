"""The global sample order of one epoch: a pure function of shard sizes, seed, epoch and partitions.

The order never depends on world size, number of workers or batch size, which is what makes
resumption on another topology continue the very same sequence.

Construction (two-level shuffle, O(blocks) memory):

1. The sample space (shards in manifest order, global ids 0..N-1) is cut into *blocks*: whole
   shards by default, or `block_size` samples when set. The blocks are shuffled (seed, epoch) and
   concatenated into one stream X of N samples.
2. X is cut into `num_partitions` contiguous *canonical partitions* of nearly equal length. A node
   that owns a partition therefore needs only the shards under its slice of X (about N / nodes).
3. Inside each partition, samples are shuffled within consecutive windows of `shuffle_window`
   samples: one window spans about `shuffle_window / shard_size + 1` shards, which is the cache a
   partition needs (the shuffle-quality / cache-size trade-off, see docs/LOADING.md).
4. Global position g takes partition g mod P, item g // P (round robin over partitions), and the
   last N mod P positions take the one extra item of the first partitions: a permutation of 0..N-1.

Only the block permutation (O(blocks)) and a few window permutations (O(shuffle_window)) are ever
held in memory, so a plan over 10^10 samples costs what 10^5 shards cost.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import numpy as np
# Imported with the order, not by its first permutation: numpy imports numpy.random on first use (6-20 ms, its
# bit generators and `secrets`), which made it part of a fresh process's first batch.
import numpy.random  # noqa: F401

from ..config import DEFAULT_SHUFFLE_WINDOW, OrderConfig
_MAX_CACHED_WINDOWS = 256


class Order(Protocol):
    """What a consumer may ask an epoch's order: its length, the sample ids at positions, their partitions.

    Implemented by `EpochOrder` (one dataset), `MixtureOrder` (several streams) and `ExcludedOrder` (any
    order with positions left out). Everything downstream (rank slices, partial batches, resume positions)
    sees only this.
    """

    @property
    def num_positions(self) -> int: ...

    def sample_ids(self, positions: np.ndarray) -> np.ndarray: ...

    def partition_of(self, positions: np.ndarray) -> np.ndarray: ...


class ExcludedOrder:
    """`base` without the positions `excluded`, the rest renumbered 0..num_positions-1 in their order.

    The one operator behind `skip_samples` and quarantine: each only decides *which* positions leave. Only
    the excluded positions are held (O(excluded)); the k-th kept position is k plus the exclusions up to it.

    Args:
        base: the order to filter.
        excluded: positions of `base` to leave out (any order; duplicates allowed).
    """

    def __init__(self, base: Order, excluded: np.ndarray):
        self.base = base
        self.excluded = np.unique(np.asarray(excluded, dtype=np.int64))
        self._shifted = self.excluded - np.arange(len(self.excluded), dtype=np.int64)
        self.num_positions = base.num_positions - len(self.excluded)

    def __len__(self) -> int:
        return self.num_positions

    def original(self, positions: np.ndarray | int) -> np.ndarray:
        """Positions of `base`.

        Raises:
            IndexError: a position outside [0, num_positions).
        """
        p = np.asarray(positions, dtype=np.int64)
        if p.size and (p.min() < 0 or p.max() >= self.num_positions):
            raise IndexError(f"position out of range for an epoch of {self.num_positions} positions "
                             f"({len(self.excluded)} excluded)")
        return p + np.searchsorted(self._shifted, p, side="right")

    def sample_ids(self, positions: np.ndarray) -> np.ndarray:
        return self.base.sample_ids(self.original(positions))

    def partition_of(self, positions: np.ndarray) -> np.ndarray:
        return self.base.partition_of(self.original(positions))


def excluding(base: Order, excluded: np.ndarray) -> Order:
    """`base` without the positions `excluded` (`base` itself when there are none)."""
    return ExcludedOrder(base, excluded) if len(excluded) else base


def make_blocks(shard_sizes: np.ndarray, block_size: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Blocks as (first global sample id, length), in sample-space order; empty shards give none."""
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    starts = np.zeros(len(sizes), dtype=np.int64)  # one array of O(shards), no temporary copies
    np.cumsum(sizes[:-1], out=starts[1:])
    if not sizes.all():  # drop empty shards (copies only then)
        keep = sizes > 0
        sizes, starts = sizes[keep], starts[keep]
    if block_size is None:
        return starts, sizes
    per_shard = -(-sizes // block_size)
    shard_of = np.repeat(np.arange(len(sizes)), per_shard)
    first_block = np.concatenate([[0], np.cumsum(per_shard)[:-1]]) if len(sizes) else per_shard
    k = np.arange(int(per_shard.sum()), dtype=np.int64) - np.repeat(first_block, per_shard)
    block_starts = starts[shard_of] + k * block_size
    block_lens = np.minimum(block_size, sizes[shard_of] - k * block_size)
    return block_starts, block_lens


class EpochOrder:
    """The order of one epoch, evaluated lazily for any array of positions.

    Args:
        shard_sizes: samples per shard, in manifest order.
        config: the order configuration.
        epoch: epoch number (reshuffles everything).
    """

    def __init__(self, shard_sizes: Sequence[int] | np.ndarray, config: OrderConfig, epoch: int):
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.config = config
        self.epoch = epoch
        block_starts, block_lens = make_blocks(np.asarray(shard_sizes, dtype=np.int64), config.block_size)
        self.num_samples = int(block_lens.sum())
        if config.shuffle and len(block_lens) > 1:
            perm = np.random.default_rng([config.seed, epoch, 1]).permutation(len(block_lens))
            block_starts = block_starts[perm]  # one at a time: the unpermuted array is freed first
            block_lens = block_lens[perm]
            del perm
        self._block_sample = block_starts          # first sample id of the k-th block of X
        self._block_end = np.cumsum(block_lens)    # end offset (in X) of the k-th block
        p = config.num_partitions
        self._part_len, self._extra = divmod(self.num_samples, p)
        self._windows: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return self.num_samples

    @property
    def num_positions(self) -> int:
        """Positions in the epoch (every sample once)."""
        return self.num_samples

    # -- structure ----------------------------------------------------------------------------
    def partition_of(self, positions: np.ndarray) -> np.ndarray:
        """Canonical partition of each global position."""
        g = np.asarray(positions, dtype=np.int64)
        p, body = self.config.num_partitions, self.config.num_partitions * self._part_len
        return np.where(g < body, g % p, g - body)

    def _partition_item(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        p, body = self.config.num_partitions, self.config.num_partitions * self._part_len
        in_body = g < body
        part = np.where(in_body, g % p, g - body)
        item = np.where(in_body, g // p, self._part_len)
        return part, item

    def _window_perm(self, part: int, window: int, size: int) -> np.ndarray:
        key = (part, window)
        perm = self._windows.get(key)
        if perm is None:
            rng = np.random.default_rng([self.config.seed, self.epoch, 2, part, window])
            perm = rng.permutation(size)
            self._windows[key] = perm
            if len(self._windows) > _MAX_CACHED_WINDOWS:
                self._windows.popitem(last=False)
        else:
            self._windows.move_to_end(key)
        return perm

    def stream_offsets(self, positions: np.ndarray) -> np.ndarray:
        """Offsets into the block stream X (after the window shuffle) of each position."""
        positions = np.asarray(positions, dtype=np.int64)
        g = positions.reshape(-1)
        if g.size and (g.min() < 0 or g.max() >= self.num_samples):
            raise IndexError(f"position out of range for an epoch of {self.num_samples} samples")
        part, item = self._partition_item(g)
        part_start = part * self._part_len + np.minimum(part, self._extra)
        if not self.config.shuffle or g.size == 0:
            return (part_start + item).reshape(positions.shape)
        part_len = self._part_len + (part < self._extra)
        w = self.config.shuffle_window
        window, offset = item // w, item % w
        window_size = np.minimum(w, part_len - window * w)
        key = part * (self._part_len // w + 2) + window
        # Group positions by (partition, window) and apply each window's permutation at once.
        by_key = np.argsort(key, kind="stable")
        sorted_key = key[by_key]
        cuts = np.flatnonzero(np.diff(sorted_key)) + 1
        shuffled = np.empty_like(offset)
        for group in np.split(by_key, cuts):
            i = group[0]
            perm = self._window_perm(int(part[i]), int(window[i]), int(window_size[i]))
            shuffled[group] = perm[offset[group]]
        return (part_start + window * w + shuffled).reshape(positions.shape)

    def sample_ids(self, positions: np.ndarray) -> np.ndarray:
        """Global sample ids (indices into the manifest's sample space) at the given positions."""
        x = self.stream_offsets(positions)
        block = np.searchsorted(self._block_end, x, side="right")
        return self._block_sample[block] + (x - self._block_begin(block))

    def _block_begin(self, block: np.ndarray) -> np.ndarray:
        """Start offset (in X) of each given block: the end of the block before it (not stored: at a
        million shards each per-block array is 8 MB)."""
        return np.where(block > 0, self._block_end[np.maximum(block - 1, 0)], 0)


    def positions_of(self, sample_ids: np.ndarray) -> np.ndarray:
        """The inverse of `sample_ids`: the position of each sample id in this epoch's order.

        Costs O(len(sample_ids)) plus one window permutation per window touched, never O(samples):
        `skip_samples` finds the positions it removes this way.

        Raises:
            IndexError: a sample id outside [0, num_samples).
        """
        ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_samples):
            raise IndexError(f"sample id out of range for a dataset of {self.num_samples} samples")
        by_sample = np.argsort(self._block_sample, kind="stable")
        block = by_sample[np.searchsorted(self._block_sample[by_sample], ids, side="right") - 1]
        x = self._block_begin(block) + (ids - self._block_sample[block])  # offset in the block stream X
        p = self.config.num_partitions
        parts = np.arange(p, dtype=np.int64)
        part_starts = parts * self._part_len + np.minimum(parts, self._extra)
        part = np.searchsorted(part_starts, x, side="right") - 1
        item = x - part_starts[part]
        if self.config.shuffle and ids.size:
            w = self.config.shuffle_window
            part_len = self._part_len + (part < self._extra)
            window, shuffled = item // w, item % w
            window_size = np.minimum(w, part_len - window * w)
            for i in range(ids.size):  # few ids: one window permutation each (cached)
                perm = self._window_perm(int(part[i]), int(window[i]), int(window_size[i]))
                item[i] = window[i] * w + int(np.flatnonzero(perm == shuffled[i])[0])
        return np.where(item < self._part_len, item * p + part, p * self._part_len + part)


def epoch_order(shard_sizes: Sequence[int] | np.ndarray, *, seed: int = 0, epoch: int = 0, num_partitions: int = 1,
                shuffle: bool = True, block_size: int | None = None,
                shuffle_window: int = DEFAULT_SHUFFLE_WINDOW) -> EpochOrder:
    """The lazily evaluated order of one epoch (see the module docstring)."""
    config = OrderConfig(shuffle=shuffle, seed=seed, num_partitions=num_partitions, block_size=block_size,
                         shuffle_window=shuffle_window)
    return EpochOrder(shard_sizes, config, epoch)


def full_order(shard_sizes: Sequence[int] | np.ndarray, **kwargs) -> np.ndarray:
    """The whole order of one epoch as an array (small datasets and tests only: O(samples))."""
    order = epoch_order(shard_sizes, **kwargs)
    return order.sample_ids(np.arange(len(order), dtype=np.int64))
