"""Invariants of the pure epoch-order functions (hypothesis) and the bounded-memory plan."""

from __future__ import annotations

import tracemalloc
from dataclasses import FrozenInstanceError

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.loaders.order.epochs import EpochOrder, OrderConfig, epoch_order, full_order, make_blocks

shard_sizes = st.lists(st.integers(0, 40), min_size=1, max_size=12).filter(lambda s: sum(s) > 0)
orders = st.fixed_dictionaries({
    "seed": st.integers(0, 2**32),
    "epoch": st.integers(0, 5),
    "num_partitions": st.integers(1, 9),
    "shuffle": st.booleans(),
    "block_size": st.one_of(st.none(), st.integers(1, 17)),
    "shuffle_window": st.integers(1, 50),
})


@settings(max_examples=150, deadline=None)
@given(sizes=shard_sizes, kwargs=orders)
def test_order_is_a_permutation(sizes, kwargs):
    order = full_order(sizes, **kwargs)
    assert sorted(order.tolist()) == list(range(sum(sizes)))


@settings(max_examples=60, deadline=None)
@given(sizes=shard_sizes, kwargs=orders)
def test_order_is_deterministic_and_lazy_evaluation_agrees(sizes, kwargs):
    whole = full_order(sizes, **kwargs)
    order = epoch_order(sizes, **kwargs)
    rng = np.random.default_rng(0)
    positions = rng.permutation(len(whole))[: max(1, len(whole) // 2)]
    np.testing.assert_array_equal(order.sample_ids(positions), whole[positions])


def test_epochs_and_seeds_reshuffle():
    sizes = [100] * 10
    base = full_order(sizes, seed=1, epoch=0, shuffle_window=300)
    assert not np.array_equal(base, full_order(sizes, seed=1, epoch=1, shuffle_window=300))
    assert not np.array_equal(base, full_order(sizes, seed=2, epoch=0, shuffle_window=300))
    np.testing.assert_array_equal(full_order(sizes, shuffle=False), np.arange(1000))
    # Two blocks are shuffled too (window 1: only the block order moves the first sample).
    assert {int(full_order([2, 2], seed=seed, shuffle_window=1)[0]) for seed in range(6)} == {0, 2}


def test_the_order_is_pinned():
    """A resumed run recomputes the order from its seed: if a release changed the order, a checkpoint of
    the previous one would silently replay some samples and skip others. Change these only on purpose."""
    assert full_order([5, 0, 3, 4], seed=7, epoch=1, num_partitions=2, shuffle_window=3).tolist() == \
        [8, 2, 9, 4, 10, 3, 11, 5, 1, 6, 0, 7]
    assert full_order([5, 0, 3, 4], seed=7, epoch=1, num_partitions=2, shuffle_window=3, block_size=2).tolist() == \
        [7, 1, 10, 6, 11, 5, 2, 4, 0, 8, 3, 9]


@settings(max_examples=60, deadline=None)
@given(sizes=shard_sizes, kwargs=orders)
def test_partition_of_names_the_slice_of_the_stream_each_position_reads(sizes, kwargs):
    order = epoch_order(sizes, **kwargs)
    n, p = len(order), kwargs["num_partitions"]
    positions = np.arange(n)
    parts = order.partition_of(positions)
    bounds = np.array([k * (n // p) + min(k, n % p) for k in range(p + 1)])
    offsets = order.stream_offsets(positions)
    assert ((bounds[parts] <= offsets) & (offsets < bounds[parts + 1])).all()


@settings(max_examples=60, deadline=None)
@given(sizes=shard_sizes, kwargs=orders)
def test_positions_of_inverts_sample_ids(sizes, kwargs):
    ids = full_order(sizes, **kwargs)
    # A fresh order: one that has computed sample_ids holds its window permutations already.
    np.testing.assert_array_equal(epoch_order(sizes, **kwargs).positions_of(ids), np.arange(len(ids)))
    np.testing.assert_array_equal(epoch_order(sizes, **kwargs).positions_of(ids[::-1]), np.arange(len(ids))[::-1])


def test_positions_and_sample_ids_out_of_range_are_refused():
    order = epoch_order([3, 4])
    for bad in ([-1], [7], [0, 7], [-1, 0]):
        with pytest.raises(IndexError, match="position out of range"):
            order.sample_ids(np.array(bad))
        with pytest.raises(IndexError, match="sample id out of range"):
            order.positions_of(np.array(bad))
    assert order.sample_ids(np.array([6])).shape == order.positions_of(np.array([6])).shape == (1,)
    assert order.sample_ids(np.zeros(0, np.int64)).size == order.positions_of(np.zeros(0, np.int64)).size == 0


def test_partitions_are_contiguous_slices_of_the_block_stream():
    # Each partition reads whole shards except at its two ends: the basis of per-node locality.
    sizes = [25] * 16
    order = epoch_order(sizes, seed=3, num_partitions=4, shuffle_window=10)
    ids = order.sample_ids(np.arange(400))
    parts = order.partition_of(np.arange(400))
    for p in range(4):
        shards = np.unique(ids[parts == p] // 25)
        assert len(shards) <= 16 // 4 + 1


def test_window_bounds_the_shards_touched():
    sizes = [100] * 50
    order = epoch_order(sizes, seed=0, shuffle_window=200)
    ids = order.sample_ids(np.arange(5000)).reshape(-1, 200)
    for window in ids:
        assert len(np.unique(window // 100)) <= 3


def test_blocks_cut_shards():
    starts, lens = make_blocks(np.array([5, 0, 3]), 2)
    assert starts.tolist() == [0, 2, 4, 5, 7] and lens.tolist() == [2, 2, 1, 2, 1]


def test_plan_of_ten_billion_samples_in_bounded_memory():
    sizes = np.full(100_000, 100_000, dtype=np.int64)  # 10^10 samples, no data
    tracemalloc.start()
    order = epoch_order(sizes, seed=7, num_partitions=16, shuffle_window=4096)
    positions = np.concatenate([np.arange(10_000), np.arange(10**10 - 10_000, 10**10), [5 * 10**9]])
    ids = order.sample_ids(positions)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(order) == 10**10
    assert peak < 64 * 2**20, f"planning used {peak / 2**20:.1f} MiB"
    assert ids.min() >= 0 and ids.max() < 10**10
    assert len(np.unique(ids)) == len(ids)


def test_config_errors_name_the_option():
    with pytest.raises(ValueError, match="num_partitions"):
        OrderConfig(num_partitions=0)
    with pytest.raises(ValueError, match="seed"):
        OrderConfig(seed=-1)
    with pytest.raises(ValueError, match="shuffle_window"):
        OrderConfig(shuffle_window=0)


def test_order_config_is_frozen_keyword_only_and_defaults_as_epoch_order():
    # An EpochOrder caches window permutations of its config: a config changed afterwards would mix orders.
    with pytest.raises(FrozenInstanceError):
        OrderConfig().seed = 1
    with pytest.raises(TypeError):
        OrderConfig(True, 0)  # noqa: FBT003 - positional arguments are what is refused
    np.testing.assert_array_equal(EpochOrder([5, 3, 4], OrderConfig(), 0).sample_ids(np.arange(12)),
                                  full_order([5, 3, 4]))
