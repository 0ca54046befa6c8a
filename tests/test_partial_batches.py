"""partial_batches="partial" on real gloo ranks: every sample exactly once per epoch, equal batch counts,
a smaller last batch (padded by fewer than world_size samples only when its rest does not split evenly)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import free_port
from loader_helpers import write_fixed
from loader_procs import loader_run

pytestmark = pytest.mark.slow


def run_group(pool, url, cache_dir, *, world, batch, samples_kwargs=None, **kwargs):
    port = free_port()
    dataset_kwargs = {"partial_batches": "partial", "shuffle_window": 1000, "seed": 7, **(samples_kwargs or {})}
    return pool.run(loader_run, [dict(url=url, cache_dir=cache_dir, batch_size=batch, rank=r, world_size=world,
                                      port=port, dataset_kwargs=dataset_kwargs, **kwargs) for r in range(world)])


def check_epoch(runs, *, samples, world, batch):
    steps = [len(r["ids"]) for r in runs]
    assert len(set(steps)) == 1 and runs[0]["steps_per_rank"] == steps and steps[0] == runs[0]["len"]
    assert all(r["mismatched"] == 0 for r in runs)
    last = {len(r["ids"][-1]) for r in runs}
    rest = samples % (world * batch)
    assert last == {-(-rest // world) if rest else batch}, "the last batches differ in size or are not smaller"
    seen = np.concatenate([np.concatenate(r["ids"]) for r in runs])
    return seen


def test_partial_delivers_48804_of_48804_on_two_ranks(process_pool, tmp_path):
    samples = 48_804  # 381 global batches of 2 x 64 and a rest of 36: 18 per rank, nothing padded
    url = str(tmp_path / "data")
    write_fixed(url, samples, seq_len=4, per_shard=4096, docs=False)
    runs = run_group(process_pool, url, str(tmp_path / "cache"), world=2, batch=64)
    seen = check_epoch(runs, samples=samples, world=2, batch=64)
    assert len(seen) == samples and np.array_equal(np.sort(seen), np.arange(samples)), \
        f"{len(np.unique(seen))} of {samples} samples delivered"


def test_partial_pads_fewer_than_world_size_when_the_rest_is_odd(process_pool, tmp_path):
    samples = 611  # 76 global batches of 2 x 4 and a rest of 3: 2 per rank, 1 position padded
    url = str(tmp_path / "data")
    write_fixed(url, samples, seq_len=8, per_shard=48, docs=False)
    runs = run_group(process_pool, url, str(tmp_path / "cache"), world=2, batch=4)
    seen = check_epoch(runs, samples=samples, world=2, batch=4)
    assert set(seen.tolist()) == set(range(samples))
    assert len(seen) == samples + 1
    # Resume mid-epoch on 3 ranks: still every sample, the last batch split over 3.
    first = run_group(process_pool, url, str(tmp_path / "cache"), world=2, batch=4, limit=40)
    second = run_group(process_pool, url, str(tmp_path / "cache"), world=3, batch=4, state=first[0]["state"])
    seen = np.concatenate([np.concatenate(r["ids"]) for r in first + second])
    assert set(seen.tolist()) == set(range(samples))
    assert len({len(r["ids"]) for r in second}) == 1
    assert len(seen) - samples < 3, "more than world_size - 1 positions padded"
