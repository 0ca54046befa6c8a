"""Task function of the start-up storm test (tests/test_manifest_storm.py), run in `ProcessPool` processes."""

from __future__ import annotations

import os

import numpy as np


def storm_rank(*, url: str, options: dict, node: int, rank: int, world_size: int, local_rank: int,
               local_world_size: int, cache_dir: str, batch_size: int, env: dict[str, str]) -> dict:
    """One rank of a simulated node: read its whole epoch; the store sees the node in the User-Agent."""
    for key, value in env.items():  # the pool started before the moto fixture set its credentials
        os.environ.setdefault(key, value)
    from shardkit.loaders.dataset import StreamingDataset

    config = dict(options.get("config_kwargs") or {}, user_agent_extra=f"storm-node-{node}")
    dataset = StreamingDataset(url, storage_options=dict(options, config_kwargs=config), cache_dir=cache_dir,
                               rank=rank, world_size=world_size, local_rank=local_rank,
                               local_world_size=local_world_size, batch_size=batch_size, seed=3)
    ids = [int(i) for batch in dataset for i in batch["sample_id"]]
    shards = np.unique(np.searchsorted(dataset.table.ends, ids, side="right"))
    return {"ids": ids, "shards": [dataset.manifests[0].shards[int(s)].name for s in shards]}
