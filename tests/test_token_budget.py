"""Token-budget batching: pure window plans (hypothesis) and real loaders over variable-length data
(exact and elastic resume: the contract in test_dataloader_resume.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loader_helpers import write_variable
from shardkit import StreamingDataLoader, StreamingDataset
from shardkit.loaders.order.token_budget import plan_remaining, plan_window


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(1, 100), min_size=1, max_size=200), world=st.integers(1, 6),
       budget=st.integers(100, 400))
def test_plan_is_equal_count_within_budget_and_complete(lengths, world, budget):
    plan = plan_window(lengths, world_size=world, max_tokens=budget)
    lengths = np.array(lengths)
    assert len({len(b) for b in plan.batches}) == 1  # equal batch counts per rank
    real = []
    for rank_batches in plan.batches:
        for batch in rank_batches:
            assert len(batch) >= 1
            filled = np.where(batch < 0, plan.filler, batch)
            assert lengths[filled].sum() <= budget
            real.extend(batch[batch >= 0].tolist())
    assert sorted(real) == list(range(len(lengths)))  # every sample exactly once
    assert plan.repeats == sum(int((b < 0).sum()) for r in plan.batches for b in r)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=5, max_size=150), a=st.integers(1, 5), b=st.integers(1, 5),
       steps=st.integers(0, 6))
def test_elastic_remainder_covers_exactly_what_is_left(lengths, a, b, steps):
    lengths = np.array(lengths)
    first = plan_window(lengths, world_size=a, max_tokens=120)
    steps = min(steps, first.steps)
    consumed = [int(i) for r in first.batches for batch in r[:steps] for i in batch if i >= 0]
    rest, covered = plan_remaining(lengths, [(a, steps)], world_size=b, max_tokens=120)
    later = [int(covered[i]) for r in rest.batches for batch in r for i in batch if i >= 0]
    assert sorted(consumed + later) == list(range(len(lengths)))


def test_sample_longer_than_budget_is_refused():
    with pytest.raises(ValueError, match="exceeds max_tokens=10"):
        plan_window([5, 11], world_size=1, max_tokens=10)


@pytest.fixture(scope="module")
def var_url(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("tok") / "data")
    write_variable(url, 700, max_len=64, per_shard=100)
    return url


def loaders(url, tmp_path, world, **kwargs):
    return [StreamingDataLoader(StreamingDataset(url, cache_dir=str(tmp_path / "c"), rank=r, world_size=world,
                                                 max_tokens=256, token_window=200, shuffle_window=150), **kwargs)
            for r in range(world)]


def take(loader, n=None):
    return [b for b in itertools.islice(loader, n)]


def test_ranks_get_equal_counts_budgeted_batches_and_balanced_tokens(var_url, tmp_path):
    per_rank = [take(loader) for loader in loaders(var_url, tmp_path, 3)]
    assert len({len(r) for r in per_rank}) == 1
    tokens = []
    ids = []
    for batches in per_rank:
        assert all(int(b["lengths"].sum()) <= 256 for b in batches)
        tokens.append(sum(int(b["lengths"].sum()) for b in batches))
        ids.extend(torch.cat([b["sample_id"] for b in batches]).tolist())
    assert set(ids) == set(range(700))  # nothing dropped in token-budget mode
    imbalance = max(tokens) / np.mean(tokens) - 1
    print(f"\ntoken imbalance across 3 ranks over the epoch: {imbalance:.4%}")
    assert imbalance <= 0.05
    with pytest.raises(TypeError, match="token-budget"):
        len(loaders(var_url, tmp_path, 1)[0])
