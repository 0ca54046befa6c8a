"""Refuse a second sharding layer on top of the rank-aware dataset (or another loader around a loader's dataset).

`StreamingDataset` already gives each rank its own share of every epoch. Frameworks that shard an
`IterableDataset` themselves do it again on top: accelerate (and so transformers' `Trainer`) either lets
rank 0 iterate and broadcasts slices of its batches (`DataLoaderDispatcher`: the other ranks' shares are
never read) or keeps every N-th batch of each rank's iteration (`IterableDatasetShard`: each rank drops
the rest of its share). Neither fails: the run silently trains on a fraction of the data. Iterated under
one of those wrappers in the same process (a DataLoader with num_workers=0, the Trainer's default), the
dataset sees the wrapper in its caller's frames and refuses, saying what to use instead.
"""

from __future__ import annotations

from .frameworks import calling_objects

# (module, class) of the wrappers that shard again what they iterate.
RESHARDING_WRAPPERS = {("accelerate.data_loader", "IterableDatasetShard"),
                       ("accelerate.data_loader", "DataLoaderDispatcher")}


def resharding_wrapper(max_depth: int = 40) -> str | None:
    """The name of a resharding wrapper among the calling frames, or None."""
    for owner in calling_objects(max_depth):
        kind = type(owner)
        if (kind.__module__, kind.__name__) in RESHARDING_WRAPPERS:
            return f"{kind.__module__}.{kind.__name__}"
    return None


def check_not_resharded(world_size: int) -> None:
    """Raise when a rank-aware iteration (`world_size` > 1) runs under a framework's own sharding.

    Raises:
        ValueError: naming the wrapper and the supported ways.
    """
    if world_size <= 1:
        return
    wrapper = resharding_wrapper()
    if wrapper is not None:
        raise ValueError(
            f"StreamingDataset is rank-aware (each of the {world_size} ranks reads its own share), but "
            f"{wrapper} shards it again: ranks would silently skip most of the data. With transformers' Trainer "
            "use shardkit.integrations.huggingface.ShardkitTrainer; with accelerate, iterate a StreamingDataLoader "
            "directly instead of passing the dataset or its loader to accelerator.prepare() (docs/INTEGRATIONS.md)")


def check_not_rewrapped(claimed_by_loader: bool) -> None:
    """Raise when a dataset that a `StreamingDataLoader` drives is iterated by another loader around it (what
    `accelerator.prepare(loader)` builds): the loader's batching and state would be bypassed.

    Raises:
        ValueError: naming what to do instead.
    """
    if claimed_by_loader:
        raise ValueError("this StreamingDataset belongs to a StreamingDataLoader but another loader iterates it "
                         "(accelerator.prepare() rebuilds a prepared loader that way, losing its batching and state): "
                         "iterate the StreamingDataLoader itself, not prepared; with accelerate, checkpoint it with "
                         "shardkit.integrations.accelerate.checkpoint_loader (docs/INTEGRATIONS.md)")
