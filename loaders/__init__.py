"""The read side of shardkit (`shardkit.loaders`): stream shards to every training rank.

Modules, one job each:

- `order`: the global sample order of an epoch (pure numpy; two-level shuffle, canonical partitions).
- `partition`: which positions each rank and DataLoader worker reads at each step (pure).
- `mixing`: `Stream` and the mixture order (pure integer arithmetic), pieces of constant weights.
- `schedule`: `Schedule`, a stream weight by loader step.
- `remix`: the mixture record of the loader state and mid-run mixture changes.
- `token_budget`: equal-count, token-balanced batches for variable-length data (pure).
- `topology`: rank, world size and node layout, resolved lazily.
- `effective_order`: an epoch's order after skip_samples and quarantine (`ExcludedOrder`s), one pure function.
- `rank_steps`: the iteration plan and this rank's (worker's) sample ids step by step (pure).
- `steps`, `token_batches`: the step sources (fixed-size, token budget) and the token-budget batch generator.
- `batch_modes`: fixed-size or token-budget batching, chosen once from the config (`BATCH_MODES`).
- `cache`: the node-local shard cache (opens, holds and prefetches shards; `make_store` resolves `cache_mode`).
- `store`: the contract of a shard store (`ShardStore`) and the handle a reader holds (`CachedShard`).
- `decoded_store`, `memory_stores`: the stores of `cache_mode` "decoded" (decode once, mmap, LRU eviction),
  "compressed" and "none" (decoded into memory at each open).
- `block_reader`: `BlockReader`, a format v2 shard read block by block (verified) before it is local.
- `cache_dir`: the node cache directory (shard file names, flock locks, temporaries, eviction).
- `closing`: what a reader left open is closed outside the garbage collector and before the interpreter's
  teardown (a shard handle's `__del__` takes no lock; unfinished reading generators are closed at exit).
- `parent_watch`: a DataLoader worker ends as soon as its parent process is gone.
- `sources`: the streams' storage, manifests and caches, opened once, and the option checks against the data.
- `batching`, `reading`, `tensors`: sample ids -> batch arrays from held shards; the reader that holds and
  prefetches them; numpy batches -> tensors (and bundles for worker pipes).
- `source`: the Source contract (`Source`, `Feed`, `Standalone`): what the dataset and the loader ask of any input.
- `built_source`, `built_feed`, `built_standalone`: built shards behind it (order, mixture, batch mode, reader,
  the next iteration; the loader's epochs; iteration without a loader).
- `raw_dataset`, `raw_loader`, `raw_mixture`, `raw_iteration`: raw text behind it (lanes, the loader's cursors,
  raw and built streams mixed).
- `dataset`: `StreamingDataset`, the torch IterableDataset that yields whole batches (the face of its source).
- `config`: `LoaderConfig`, the order, batching and cache options (its order fields make the resume state).
- `state`, `dataloader`: the resume state (composed of the stages' `state()`) and `StreamingDataLoader`.

The public names (`__all__`): `StreamingDataset`, `StreamingDataLoader`, `LoaderConfig`, `Stream`,
`Schedule` and `start_metrics_server`, also importable from `shardkit`. This package imports torch only
in `dataset` and `dataloader`, when one of their names is first used.
"""

from __future__ import annotations

from shardkit.lazy import lazy_names
from shardkit.metrics import start_metrics_server  # Prometheus endpoint for users' own loops

# Public name -> module that defines it, imported on first use (PEP 562): `import shardkit.loaders`
# does not import torch.
_LAZY_NAMES = {
    "StreamingDataset": "shardkit.loaders.dataset",
    "StreamingDataLoader": "shardkit.loaders.dataloader",
    "LoaderConfig": "shardkit.loaders.config",
    "Stream": "shardkit.loaders.mixing",
    "Schedule": "shardkit.loaders.schedule",
}

__all__ = [*_LAZY_NAMES, "start_metrics_server"]

__getattr__, __dir__ = lazy_names(__name__, _LAZY_NAMES, globals())
