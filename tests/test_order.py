"""Invariants of the pure epoch-order functions (hypothesis) and the bounded-memory plan."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.loaders.order import OrderConfig, epoch_order, full_order, make_blocks

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
