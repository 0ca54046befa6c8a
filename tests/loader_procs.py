"""Task functions that the multi-process loader tests run in `ProcessPool` processes."""

from __future__ import annotations

import itertools
import os


def _set_env(env: dict | None) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(key, None)
    os.environ.update(env or {})


def loader_run(*, url: str, cache_dir: str, batch_size: int, rank: int | None = None, world_size: int | None = None,
               port: int | None = None, limit: int | None = None, state: dict | None = None, num_workers: int = 0,
               env: dict | None = None, dataset_kwargs: dict | None = None, storage_options: dict | None = None,
               mesh: bool = False, allow_mixture_change: bool = False) -> dict:
    """Iterate a StreamingDataLoader as one rank; with `port`, inside a real gloo process group.

    The dataset is created *before* init_process_group and given no rank, so the rank must come
    from the group at iteration time. Every step does an all_reduce, as DDP would: unequal batch
    counts would hang (and time out) here. With `mesh`, the dataset is created after the group and
    takes its rank from a DeviceMesh's data-parallel dimension instead.
    """
    import numpy as np
    import torch
    import torch.distributed as dist

    from shardkit import StreamingDataLoader, StreamingDataset
    from loader_helpers import ids_from_tokens

    _set_env(env)
    kwargs = dict(dataset_kwargs or {})
    if port is None:
        kwargs.update(rank=rank, world_size=world_size)
    if not mesh:
        dataset = StreamingDataset(url, cache_dir=cache_dir, storage_options=storage_options, **kwargs)
    if port is not None:
        from datetime import timedelta
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=60))
    if mesh:
        from torch.distributed.device_mesh import init_device_mesh

        dp = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
        dataset = StreamingDataset(url, cache_dir=cache_dir, storage_options=storage_options, device_mesh=dp,
                                   mesh_dim="dp", **kwargs)
    try:
        # Pool processes are spawned, which makes spawn their default start method; torchrun's ranks
        # fork their DataLoader workers, and so do we (a spawned worker re-imports torch: seconds).
        loader = StreamingDataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                                     multiprocessing_context="fork" if num_workers else None)
        if state is not None:
            loader.load_state_dict(state, allow_mixture_change=allow_mixture_change)
        ids, mismatched = [], 0
        for batch in itertools.islice(loader, limit):
            ids.append(batch["sample_id"].numpy().copy())
            mismatched += int(np.sum(ids_from_tokens(batch["tokens"]) != ids[-1]))
            if port is not None:
                dist.all_reduce(torch.ones(1))
        steps = torch.tensor([len(ids)])
        if port is not None:
            everyone = [torch.zeros(1, dtype=torch.long) for _ in range(world_size)]
            dist.all_gather(everyone, steps)
            steps_per_rank = [int(t) for t in everyone]
        else:
            steps_per_rank = [len(ids)]
        stats = [c.stats.__dict__ for c in dataset.caches]
        return {"ids": ids, "state": loader.state_dict(), "len": len(loader), "steps_per_rank": steps_per_rank,
                "mismatched": mismatched, "stats": stats}
    finally:
        if port is not None:
            dist.destroy_process_group()


def open_shards(*, url: str, cache_dir: str, order: list[int], cache_limit: int | None = None, hold: int = 1,
                storage_options: dict | None = None, env: dict | None = None, cache_wait: float = 60.0) -> dict:
    """Open shards in `order` through the cache, holding `hold` at a time; check every sample."""
    import numpy as np

    from shardkit.loaders.cache.shard_cache import ShardCache
    from shardkit.manifest import load_manifest
    from shardkit.storage import Storage
    from loader_helpers import ids_from_tokens

    _set_env(env)
    storage = Storage(url, storage_options)
    manifest = load_manifest(storage)
    cache = ShardCache(storage, manifest, cache_dir, cache_limit=cache_limit, wait_timeout=cache_wait)
    starts = np.concatenate([[0], np.cumsum([s.samples for s in manifest.shards])])
    held, bad = [], 0
    for index in order:
        handle = cache.open(index)
        reader = handle.reader
        expected = np.arange(starts[index], starts[index + 1])
        bad += int(np.sum(ids_from_tokens(reader.gather(np.arange(len(reader)))) != expected))
        held.append(handle)
        if len(held) > hold:
            held.pop(0).close()
    for handle in held:
        handle.close()
    return {"bad": bad, **cache.stats.__dict__}
