"""The read side of shardkit (`shardkit.loaders`): stream shards to every training rank.

The wings, one job each (docs/LOADING.md, "How the read side is put together"):

- `source`: the Source contract (`Source`, `Feed`, `Standalone`): what the dataset and the loader ask of any input.
- `dataset`, `dataloader`: `StreamingDataset` and `StreamingDataLoader`, one each for every source.
- `config`: `LoaderConfig`, the order, batching and cache options (its order fields make the resume state).
- `sources/`: the sources. `built/`: built shards (`source`: order, mixture, batch mode, reader and the next
  iteration; `feed`: the loader's epochs; `standalone`: iteration without a loader; `streams`: each stream's
  storage, manifest and cache, opened once; `reading`, `batching`: sample ids -> batch arrays; `provenance`: a
  sample's shard and documents). `raw/`: raw text (`source`, `feed`: the lanes' cursors; `corpus`: units dealt
  into lanes and one lane's samples; `units`, `unreadable`, `batches`, `iteration`; `worker_start`: where
  persistent workers begin an iteration; `provenance`: a sample made again from its lane). `mixture`: raw and
  built streams in one weighted mixture; `documents`:
  a batch's document boundaries.
- `order/`: which sample goes where, pure (`epochs`: an epoch's order; `partition`, `effective`, `rank_steps`,
  `steps`, `batch_modes`, `token_budget`, `token_batches`; `mixing`, `schedule`, `remix`: mixtures and their
  changes; `skipping`, `quarantine`; `lanes`, `mixed_lanes`: raw text's lanes and a raw mixture's order).
- `cache/`: the node-local shard cache (`shard_cache`; `store`, `decoded_store`, `memory_stores`: one store per
  `cache_mode`; `directory`; a format v2 shard read block by block before it is local: `shard_blocks` (each block
  fetched, verified, decoded, placed), `block_completion` (the rest in the background), `block_reader` (what a
  batch asks for)).
- `state/`: `loader_state` (the resume state, composed of the stages' `state()`), `fingerprint` (data identity).
- `delivery/`: `topology`, `tensors`, `batch_counts`, `closing`, `parent_watch`, `worker_copies`, `frameworks`,
  `resharding`: how batches reach the training loop and what guards it.

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
    "Stream": "shardkit.loaders.order.mixing",
    "Schedule": "shardkit.loaders.order.schedule",
}

__all__ = [*_LAZY_NAMES, "start_metrics_server"]

__getattr__, __dir__ = lazy_names(__name__, _LAZY_NAMES, globals())
