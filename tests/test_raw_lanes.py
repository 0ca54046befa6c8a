"""The raw-text order's pure functions: lanes, lane epochs, rank slices, cursors."""

import numpy as np
import pytest

from shardkit.loaders.order.lanes import (deal_lanes, lane_epoch_order, lane_sample_counts, lane_units, merge_cursors,
                                        position_lanes, rank_step_positions)


def test_lanes_are_balanced_deterministic_and_complete():
    sizes = np.random.default_rng(0).integers(1, 1000, size=200)
    lanes = deal_lanes(sizes, 8)
    assert np.array_equal(lanes, deal_lanes(sizes, 8))
    held = np.bincount(lanes, weights=sizes, minlength=8)
    assert held.max() - held.min() <= sizes.max()  # greedy largest-first: within one unit
    units = lane_units(lanes, 8)
    assert sorted(np.concatenate(units).tolist()) == list(range(200))
    for lane, mine in enumerate(units):
        assert (lanes[mine] == lane).all() and (np.diff(mine) > 0).all()  # corpus order inside a lane


def test_more_lanes_than_units_is_refused():
    with pytest.raises(ValueError, match="lanes .3. exceeds the corpus's 2 work units"):
        deal_lanes(np.array([5, 6]), 3)


def test_lane_epoch_order_is_a_permutation_seeded_by_epoch_and_lane():
    a = lane_epoch_order(50, seed=1, epoch=0, lane=3)
    assert sorted(a.tolist()) == list(range(50))
    assert np.array_equal(a, lane_epoch_order(50, seed=1, epoch=0, lane=3))
    assert not np.array_equal(a, lane_epoch_order(50, seed=1, epoch=1, lane=3))
    assert not np.array_equal(a, lane_epoch_order(50, seed=1, epoch=0, lane=4))
    assert not np.array_equal(a, lane_epoch_order(50, seed=2, epoch=0, lane=3))
    assert lane_epoch_order(5, seed=1, epoch=2, lane=0, shuffle=False).tolist() == [0, 1, 2, 3, 4]


def test_lane_sample_counts_match_the_consumed_prefix():
    for consumed in (0, 1, 7, 8, 9, 100):
        lanes, _ = position_lanes(np.arange(consumed), 8)
        assert lane_sample_counts(consumed, 8).tolist() == np.bincount(lanes, minlength=8).tolist()


@pytest.mark.parametrize("global_batch,lanes", [(12, 4), (12, 5), (6, 16), (24, 7)])
def test_ranks_concatenated_give_the_same_rows_for_any_world_size(global_batch, lanes):
    for start in (0, 5):
        for step in range(4):
            rows = {}
            for world in (1, 2, 3):
                rows[world] = np.concatenate([rank_step_positions(step, start=start, world_size=world,
                                                                  batch_size=global_batch // world, rank=r,
                                                                  num_lanes=lanes) for r in range(world)])
            assert np.array_equal(rows[1], rows[2]) and np.array_equal(rows[1], rows[3])
            expected = start + step * global_batch + np.arange(global_batch)
            assert sorted(rows[1].tolist()) == expected.tolist()  # every position once
            assert (np.diff(rows[1] % lanes) >= 0).all()  # sorted by lane


def test_a_rank_reads_few_lanes():
    lanes, world, batch = 64, 4, 48  # the global batch is 3 x lanes: each rank a quarter of the lanes
    for step in range(5):
        for rank in range(world):
            mine = set((rank_step_positions(step, start=0, world_size=world, batch_size=batch, rank=rank,
                                            num_lanes=lanes) % lanes).tolist())
            assert mine == set(range(rank * 16, rank * 16 + 16))
    lanes, world, batch = 10, 3, 5  # not a multiple: still about lanes / world + 2
    for step in range(7):
        for rank in range(world):
            mine = set((rank_step_positions(step, start=3, world_size=world, batch_size=batch, rank=rank,
                                            num_lanes=lanes) % lanes).tolist())
            assert len(mine) <= lanes // world + 2


def test_merge_cursors_keeps_the_furthest_cursor_of_each_lane():
    a = {0: (3, 0, 1, 2), 1: (5, 1, 0, 0)}
    b = {"0": (4, 0, 1, 3), 2: (1, 0, 0, 1)}
    assert merge_cursors(a, b) == {0: (4, 0, 1, 3), 1: (5, 1, 0, 0), 2: (1, 0, 0, 1)}
