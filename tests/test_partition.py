"""Rank and worker shares of the global order: disjoint, equal, complete, world-size independent."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.loaders.order.epochs import epoch_order
from shardkit.loaders.order.partition import dropped_in_epoch, rank_positions, steps_in_epoch, worker_steps


def shares(order, *, world, batch, start=0, policy="drop"):
    n = order.num_positions
    steps = np.arange(steps_in_epoch(n, start=start, global_batch=world * batch, policy=policy))
    return [order.sample_ids(rank_positions(steps, start=start, num_positions=n, world_size=world,
                                            batch_size=batch, rank=r, partition_of=order.partition_of))
            for r in range(world)]


@settings(max_examples=120, deadline=None)
@given(sizes=st.lists(st.integers(0, 30), min_size=1, max_size=10).filter(lambda s: sum(s) > 0),
       partitions=st.integers(1, 6), world=st.integers(1, 6), batch=st.integers(1, 5), seed=st.integers(0, 100))
def test_rank_shares_disjoint_equal_complete(sizes, partitions, world, batch, seed):
    order = epoch_order(sizes, seed=seed, num_partitions=partitions, shuffle_window=7)
    per_rank = shares(order, world=world, batch=batch)
    n, global_batch = sum(sizes), world * batch
    assert len({r.shape for r in per_rank}) == 1  # equal
    got = np.concatenate([r.reshape(-1) for r in per_rank])
    assert len(np.unique(got)) == len(got)  # disjoint
    # complete: exactly the first steps * global_batch positions of the global order
    steps = n // global_batch
    expected = order.sample_ids(np.arange(steps * global_batch))
    assert sorted(got.tolist()) == sorted(expected.tolist())
    assert dropped_in_epoch(n, global_batch=global_batch) == n - steps * global_batch


@settings(max_examples=60, deadline=None)
@given(world_a=st.integers(1, 5), world_b=st.integers(1, 5), batch=st.integers(1, 4), cut=st.integers(0, 20))
def test_elastic_continuation_is_the_same_global_order(world_a, world_b, batch, cut):
    order = epoch_order([23, 17, 31], seed=5, num_partitions=2, shuffle_window=9)
    n = order.num_positions
    cut = min(cut, n // (world_a * batch))
    first = shares(order, world=world_a, batch=batch)
    before = np.concatenate([r[:cut].reshape(-1) for r in first]) if cut else np.zeros(0, np.int64)
    start = cut * world_a * batch
    after = np.concatenate([r.reshape(-1) for r in shares(order, world=world_b, batch=batch, start=start)])
    both = np.concatenate([before, after])
    assert len(np.unique(both)) == len(both)  # nothing repeated
    # nothing skipped: exactly a prefix of the global order, short of less than one global step
    assert sorted(both.tolist()) == sorted(order.sample_ids(np.arange(len(both))).tolist())
    assert n - len(both) < world_b * batch


def test_pad_policy_repeats_from_the_start():
    order = epoch_order([10], shuffle=False)
    per_rank = shares(order, world=3, batch=2, policy="pad")
    got = np.concatenate([r.reshape(-1) for r in per_rank])
    assert len(got) == 12 and set(got.tolist()) == set(range(10))
    assert dropped_in_epoch(10, global_batch=6, policy="pad") == -2


def test_locality_each_node_reads_its_partitions():
    order = epoch_order([50] * 16, seed=1, num_partitions=4, shuffle_window=25)
    per_rank = shares(order, world=8, batch=4)  # 4 nodes x 2 ranks
    for node in range(4):
        ids = np.concatenate([per_rank[2 * node].reshape(-1), per_rank[2 * node + 1].reshape(-1)])
        parts = np.unique(order.partition_of(np.flatnonzero(np.isin(order.sample_ids(np.arange(800)), ids))))
        assert parts.tolist() == [node]


def test_worker_steps_round_robin():
    assert worker_steps(7, worker=1, num_workers=3).tolist() == [1, 4]
    with pytest.raises(ValueError, match="worker"):
        worker_steps(7, worker=3, num_workers=3)


def test_edges_of_the_step_and_rank_arithmetic():
    from shardkit.loaders.order.partition import worker_of_step

    # without bundling, workers take single steps round robin
    assert worker_of_step(np.arange(5), num_workers=2).tolist() == [0, 1, 0, 1, 0]
    same = dict(start=0, num_positions=10, world_size=2, batch_size=2, partition_of=np.zeros_like)
    with pytest.raises(ValueError, match="rank 2"):
        rank_positions(np.arange(1), rank=2, **same)
    # pad policy on a one-sample epoch: every padded position wraps to that sample
    assert rank_positions(np.arange(2), start=0, num_positions=1, world_size=1, batch_size=3, rank=0,
                          partition_of=np.zeros_like).tolist() == [[0, 0, 0], [0, 0, 0]]


@settings(max_examples=120, deadline=None)
@given(sizes=st.lists(st.integers(0, 30), min_size=1, max_size=10).filter(lambda s: sum(s) > 0),
       partitions=st.integers(1, 4), world=st.integers(1, 5), batch=st.integers(1, 5), seed=st.integers(0, 100))
def test_partial_policy_every_sample_once_equal_batches(sizes, partitions, world, batch, seed):
    from shardkit.loaders.order.partition import partial_batch

    order = epoch_order(sizes, seed=seed, num_partitions=partitions, shuffle_window=7)
    n, global_batch = order.num_positions, world * batch
    total = steps_in_epoch(n, start=0, global_batch=global_batch, policy="partial")
    last = partial_batch(n, start=0, global_batch=global_batch, world_size=world, policy="partial")
    full = np.arange(total if last is None else total - 1)
    per_rank = []
    for r in range(world):
        ids = [order.sample_ids(rank_positions(full, start=0, num_positions=n, world_size=world, batch_size=batch,
                                               rank=r, partition_of=order.partition_of)).reshape(-1)]
        if last is not None:
            ids.append(order.sample_ids(rank_positions(np.array([total - 1]), start=0, num_positions=n,
                                                       world_size=world, batch_size=last, rank=r,
                                                       partition_of=order.partition_of, stride=global_batch)).reshape(-1))
        per_rank.append(np.concatenate(ids))
    got = np.concatenate(per_rank)
    assert len({len(r) for r in per_rank}) == 1  # equal batch counts and sizes on every rank
    assert set(got.tolist()) == set(range(n))  # every sample
    padded = len(got) - n
    assert padded == -dropped_in_epoch(n, global_batch=global_batch, policy="partial", world_size=world)
    assert 0 <= padded < world and (padded == 0) == ((n % global_batch) % world == 0)
    assert last is None or last <= batch


def test_partial_step_arithmetic_at_its_edges():
    """The ragged last step counts the positions left after `start` (not before it, not one more), an
    epoch already consumed has no partial step, and the whole-epoch count defaults to one rank."""
    from shardkit.loaders.order.partition import partial_batch

    assert partial_batch(10, start=3, global_batch=4, world_size=1, policy="partial") == 3  # 7 left: 4 + 3
    assert partial_batch(12, start=3, global_batch=4, world_size=2, policy="partial") == 1  # 9 left: 8 + 1
    assert partial_batch(8, start=8, global_batch=4, world_size=1, policy="partial") is None
    assert partial_batch(8, start=9, global_batch=4, world_size=1, policy="partial") is None
    assert partial_batch(10, start=3, global_batch=4, world_size=1, policy="drop") is None
    # 11 positions, global batch 4: two full steps and 3 left; one rank reads them all, two ranks read
    # ceil(3 / 2) = 2 each, one repeated.
    assert dropped_in_epoch(11, global_batch=4, policy="partial") == 0
    assert dropped_in_epoch(11, global_batch=4, policy="partial", world_size=2) == -1


def test_worker_step_arithmetic_defaults_to_single_steps_and_integer_bundles():
    from shardkit.loaders.order.partition import worker_of_step, worker_step_chunks, worker_step_count

    assert worker_of_step(3, num_workers=2, bundle=2) == 1 and isinstance(worker_of_step(3, num_workers=2, bundle=2), int)
    # the first round's bundles one step per message (the ramp), then bundles of two
    assert worker_of_step(np.arange(8), num_workers=2, bundle=2).tolist() == [0, 1, 0, 1, 0, 0, 1, 1]
    assert worker_step_count(6, worker=0, num_workers=2) == 3  # bundle 1 by default
    assert [c.tolist() for c in worker_step_chunks(6, worker=0, num_workers=2, chunk=10)] == [[0, 2, 4]]
    # a chunk of one step is allowed, and yields one step at a time
    assert [c.tolist() for c in worker_step_chunks(4, worker=1, num_workers=2, chunk=1)] == [[1], [3]]
    with pytest.raises(ValueError, match="chunk"):
        list(worker_step_chunks(4, worker=1, num_workers=2, chunk=0))
    # a worker with no step gets an empty array, not a step 0
    assert worker_steps(1, worker=1, num_workers=2).tolist() == []


def test_worker_step_chunks_skip_starts_at_the_skipped_step_at_once():
    from shardkit.loaders.order.partition import worker_step_chunks

    every = np.concatenate(list(worker_step_chunks(50, worker=1, num_workers=3, bundle=2, chunk=4)))
    assert len(every) == 16  # its first bundle of 2 as the ramp's two messages of 1, then 7 bundles of 2
    for skip in (0, 1, 4, 7, 15, 16, 17):
        kept = list(worker_step_chunks(50, worker=1, num_workers=3, bundle=2, chunk=4, skip=skip))
        assert [int(s) for c in kept for s in c] == every[skip:].tolist()
        assert all(0 < len(c) <= 4 for c in kept)  # no chunk spent on skipped steps
        # cut at the ramp's two messages and, after it, at the worker's steps 4, 8, ... (whole bundles of 2)
        assert len(kept) <= -(-max(0, len(every) - skip) // 4) + 2
    # a standalone worker resumed near the end of an epoch of 10^8 steps: its first chunk comes at once
    # (enumerating the 6 million chunks before it took seconds)
    cpu = time.process_time()
    first = next(worker_step_chunks(10**8, worker=0, num_workers=2, bundle=4, chunk=8, skip=5 * 10**7 - 3))
    assert first.tolist() == [10**8 - 7, 10**8 - 6, 10**8 - 5]
    assert time.process_time() - cpu < 1.0


@settings(max_examples=150, deadline=None)
@given(num_steps=st.integers(0, 300), num_workers=st.integers(1, 4), bundle=st.integers(1, 20),
       chunk=st.integers(1, 9), skip=st.integers(0, 40))
def test_workers_take_one_step_first_then_bundles_that_arrive_in_step_order(num_steps, num_workers, bundle, chunk,
                                                                           skip):
    """Round robin, each worker's messages as `bundled` cuts them (1, 1, 2, 4, ... adding up to `bundle`, then
    `bundle` steps): read in torch's order (one message per worker in turn) they give every step once, in order,
    and each worker's steps are what `worker_of_step`, `worker_step_count` and `worker_step_chunks` say. The ramp
    only splits the first round: every later step goes to the worker a dealing of whole bundles gives it, and no
    chunk spans two messages of the ramp (the reader holds a chunk's shards: a chunk across two of them spans
    the other workers' steps between them too)."""
    from shardkit.loaders.order.partition import worker_of_step, worker_step_chunks, worker_step_count
    from shardkit.loaders.delivery.tensors import bundled

    owner = worker_of_step(np.arange(num_steps), num_workers=num_workers, bundle=bundle)
    after_ramp = np.arange(num_workers * bundle, num_steps)
    assert owner[after_ramp].tolist() == ((after_ramp // bundle) % num_workers).tolist()
    messages = []
    for worker in range(num_workers):
        mine = np.flatnonzero(owner == worker)
        assert worker_step_count(num_steps, worker=worker, num_workers=num_workers, bundle=bundle) == len(mine)
        chunks = list(worker_step_chunks(num_steps, worker=worker, num_workers=num_workers, bundle=bundle,
                                         chunk=chunk, skip=skip))
        assert [int(s) for c in chunks for s in c] == mine[skip:].tolist()
        messages.append(list(bundled(iter(mine.tolist()), bundle)))
        ramp = [set(m) for m in messages[-1][:-1] if len(m) < bundle]  # the ramp's messages (but the last)
        assert not any(len(ramp_message & set(c.tolist())) not in (0, len(c)) for c in chunks for ramp_message in ramp)
    assert all(len(m[0]) == 1 for m in messages if m)  # every worker's first message: one batch
    arrived = [step for round_ in itertools.zip_longest(*messages, fillvalue=[]) for message in round_
               for step in message]
    assert arrived == list(range(num_steps))
