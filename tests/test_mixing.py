"""Mixture order: exact quotas, stated tolerance, permutation per stream cycle, elastic shares."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.loaders.order.mixing import MIX_PERIOD, MixtureOrder, Stream, mixture_quotas
from shardkit.loaders.order.epochs import OrderConfig
from shardkit.loaders.order.partition import rank_positions


@settings(max_examples=100, deadline=None)
@given(weights=st.lists(st.floats(0.05, 50), min_size=1, max_size=6), start=st.integers(0, 10**12),
       n=st.integers(1, 3000))
def test_any_run_of_positions_follows_the_weights_within_tolerance(weights, start, n):
    sizes = [np.array([7, 5])] * len(weights)
    order = MixtureOrder(sizes, weights, OrderConfig(seed=1), epoch=0, epoch_size=10**13)
    quotas = mixture_quotas(weights)
    assert quotas.sum() == MIX_PERIOD
    assert np.all(np.abs(quotas / MIX_PERIOD - np.array(weights) / sum(weights)) <= 1 / MIX_PERIOD)
    stream, _ = order.stream_items(np.arange(start, start + n))
    counts = np.bincount(stream, minlength=len(weights))
    # stated tolerance: max(1, streams - 1) in any run of positions (see the mixing docstring)
    assert np.all(np.abs(counts - n * quotas / MIX_PERIOD) <= max(1, len(weights) - 1) + 1e-9)


def test_each_stream_is_consumed_in_whole_reshuffled_cycles():
    sizes = [np.array([30, 20]), np.array([10])]
    order = MixtureOrder(sizes, [1, 1], OrderConfig(seed=3, shuffle_window=8), epoch=0, epoch_size=120)
    ids = order.sample_ids(np.arange(120))
    small = ids[ids >= 50] - 50
    assert len(small) == 60
    cycles = small.reshape(6, 10)
    assert all(sorted(c) == list(range(10)) for c in cycles)
    assert len({tuple(c) for c in cycles}) > 1  # each cycle is a new epoch of that stream
    big = ids[ids < 50]
    assert sorted(big[:50]) == list(range(50))


def test_mixture_order_is_pure_and_elastic():
    sizes = [np.array([40, 40]), np.array([25])]
    make = lambda: MixtureOrder(sizes, [2, 1], OrderConfig(seed=9, num_partitions=2, shuffle_window=16), epoch=1)
    a, b = make(), make()
    np.testing.assert_array_equal(a.sample_ids(np.arange(105)), b.sample_ids(np.arange(105)))
    # 2 ranks for 5 steps, then 3 ranks: the same positions of the same order, none twice
    before = [a.sample_ids(rank_positions(np.arange(5), start=0, num_positions=105, world_size=2, batch_size=3,
                                          rank=r, partition_of=a.partition_of)) for r in range(2)]
    after = [a.sample_ids(rank_positions(np.arange(8), start=30, num_positions=105, world_size=3, batch_size=3,
                                         rank=r, partition_of=a.partition_of)) for r in range(3)]
    got = sorted(np.concatenate([x.reshape(-1) for x in before + after]).tolist())
    assert got == sorted(a.sample_ids(np.arange(102)).tolist())


def test_stream_validation():
    with pytest.raises(ValueError, match="weight"):
        Stream("s3://x", weight=0)
    with pytest.raises(ValueError, match="never be sampled"):
        mixture_quotas([1, 1e-6])
