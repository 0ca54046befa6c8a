"""Real multi-process runs (gloo): balance, exact resume and elastic resume across world sizes."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import free_port
from loader_helpers import write_fixed
from loader_procs import loader_run

pytestmark = pytest.mark.slow

BATCH = 4
SAMPLES = 611  # 13 shards of 48 and a ragged last shard


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    url = str(root / "data")
    write_fixed(url, SAMPLES, seq_len=16, per_shard=48)
    return url, str(root / "cache")


def run_group(pool, dataset, world, **kwargs):
    url, cache_dir = dataset
    port = free_port()
    kwargs.setdefault("dataset_kwargs", {"shuffle_window": 100, "seed": 11})
    return pool.run(loader_run, [dict(url=url, cache_dir=cache_dir, batch_size=BATCH, rank=r, world_size=world,
                                      port=port, **kwargs) for r in range(world)])


def flat(result):
    return np.concatenate(result["ids"]) if result["ids"] else np.zeros(0, np.int64)


def test_balance_and_exact_resume(process_pool, dataset):
    full = run_group(process_pool, dataset, 2)
    # balance: every rank got the same number of batches, equal to len(loader); no DDP hang
    assert [r["len"] for r in full] == [SAMPLES // 8] * 2
    assert full[0]["steps_per_rank"] == [SAMPLES // 8] * 2
    assert all(r["mismatched"] == 0 for r in full)
    ids = np.concatenate([flat(r) for r in full])
    assert len(np.unique(ids)) == len(ids) == SAMPLES // 8 * 8
    # exact resume: kill after 29 steps (state saved), restart the same world size
    first = run_group(process_pool, dataset, 2, limit=29)
    assert first[0]["state"] == first[1]["state"], "the state must be global (identical on every rank)"
    second = run_group(process_pool, dataset, 2, state=first[0]["state"])
    for rank in range(2):
        resumed = np.concatenate([flat(first[rank]), flat(second[rank])])
        np.testing.assert_array_equal(resumed, flat(full[rank]))


@pytest.mark.parametrize(("before", "after", "workers_after", "mesh"), [(2, 3, 2, False), (4, 2, 0, True)])
def test_elastic_resume_repeats_and_skips_nothing(process_pool, dataset, before, after, workers_after, mesh):
    first = run_group(process_pool, dataset, before, limit=23)
    state = first[0]["state"]
    assert state["position"]["samples"] == 23 * before * BATCH
    # the second run takes its rank from a DeviceMesh dimension when `mesh`
    second = run_group(process_pool, dataset, after, state=state, num_workers=workers_after, mesh=mesh)
    assert len({r["len"] for r in second}) == 1 and second[0]["steps_per_rank"] == [len(second[0]["ids"])] * after
    seen = np.concatenate([flat(r) for r in first + second])
    assert len(np.unique(seen)) == len(seen), "a sample was repeated across the resume"
    # nothing skipped: all samples of the epoch except the ragged tail of less than one global step
    missing = SAMPLES - len(seen)
    assert 0 <= missing < after * BATCH
    assert set(seen.tolist()) <= set(range(SAMPLES))
