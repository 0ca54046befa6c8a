"""`order.effective`: an epoch's order after skip_samples and quarantine, one pure function of its inputs
(issue 23 item 1). Each result is checked against the brute-force answer computed from whole orders."""

from __future__ import annotations

import numpy as np
import pytest

from shardkit.loaders.order.effective import effective_order
from shardkit.loaders.order.mixing import MixtureOrder, MixturePlan
from shardkit.loaders.order.epochs import EpochOrder, OrderConfig

SIZES = np.array([40] * 9 + [23], dtype=np.int64)
ENDS = np.cumsum(SIZES)
CONFIG = OrderConfig(seed=5, num_partitions=2, shuffle_window=30)


def ids_of(order) -> np.ndarray:
    return order.sample_ids(np.arange(order.num_positions, dtype=np.int64))


def shard_of(ids: np.ndarray) -> np.ndarray:
    return np.searchsorted(ENDS, ids, side="right")


def test_no_exclusion_is_the_base_order():
    got = effective_order([SIZES], CONFIG, 3)
    np.testing.assert_array_equal(ids_of(got), ids_of(EpochOrder(SIZES, CONFIG, 3)))


def test_skip_then_quarantine_from_its_activation_position_of_the_skipped_order():
    base = ids_of(EpochOrder(SIZES, CONFIG, 1))
    skipped = np.array([0, 7, 41, 42, 200, 382], dtype=np.int64)
    after_skip = base[~np.isin(base, skipped)]  # the rest keep their order
    # Shard 2 from the start; shard 6 from the middle of its positions, counted in the order after skipping.
    cut = int(np.median(np.flatnonzero(shard_of(after_skip) == 6)))
    entries = ((2, 1, 0), (6, 1, cut), (8, 2, 0))  # shard 8's entry belongs to a later epoch: not yet
    got = effective_order([SIZES], CONFIG, 1, skipped=skipped, quarantine=entries)
    where = np.arange(len(after_skip))
    keep = ~((shard_of(after_skip) == 2) | ((shard_of(after_skip) == 6) & (where >= cut)))
    assert 0 < np.sum(keep & (shard_of(after_skip) == 6)) < SIZES[6]  # part of shard 6 was read before
    np.testing.assert_array_equal(ids_of(got), after_skip[keep])
    partitions = got.partition_of(np.arange(got.num_positions))
    assert set(np.unique(partitions).tolist()) == {0, 1}
    # The next epoch leaves out the shards from its start, and shard 8 from its own entry's epoch on.
    later = ids_of(effective_order([SIZES], CONFIG, 2, skipped=skipped, quarantine=entries))
    base2 = ids_of(EpochOrder(SIZES, CONFIG, 2))
    np.testing.assert_array_equal(later, base2[~np.isin(base2, skipped) & ~np.isin(shard_of(base2), [2, 6, 8])])


def test_the_same_inputs_give_the_same_order_in_any_call_order():
    entries = ((3, 0, 100),)
    first = [ids_of(effective_order([SIZES], CONFIG, e, skipped=np.array([5]), quarantine=entries)) for e in (0, 1)]
    again = [ids_of(effective_order([SIZES], CONFIG, e, skipped=np.array([5]), quarantine=entries)) for e in (1, 0)]
    np.testing.assert_array_equal(first[0], again[1])
    np.testing.assert_array_equal(first[1], again[0])
    assert not np.array_equal(first[0], first[1])  # epochs reshuffle


def test_a_mixture_leaves_out_its_quarantined_shards_positions():
    streams = [SIZES[:5], SIZES[5:]]
    plan = MixturePlan(weights=(2.0, 1.0), seed_keys=(0, 1), epoch_size=300)
    base = ids_of(MixtureOrder(streams, plan.weights, CONFIG, 0, plan=plan))
    cut = int(np.median(np.flatnonzero(shard_of(base) == 7)))  # part of shard 7 was read before
    got = effective_order(streams, CONFIG, 0, mixture=plan, quarantine=((1, 0, 0), (7, 0, cut)))
    where = np.arange(len(base))
    keep = ~((shard_of(base) == 1) | ((shard_of(base) == 7) & (where >= cut)))
    assert np.sum(keep & (shard_of(base) == 7)) > 0 and np.sum(shard_of(base) == 1) > 0
    np.testing.assert_array_equal(ids_of(got), base[keep])


def test_inputs_that_do_not_compose_are_refused():
    with pytest.raises(ValueError, match="mixture of 2 streams needs its mixture plan"):
        effective_order([SIZES[:5], SIZES[5:]], CONFIG, 0)
    plan = MixturePlan(weights=(1.0, 1.0), seed_keys=(0, 1), epoch_size=100)
    with pytest.raises(ValueError, match="skip_samples applies to a single dataset"):
        effective_order([SIZES[:5], SIZES[5:]], CONFIG, 0, mixture=plan, skipped=np.array([1]))
