"""shardkit: tokenized-shard datasets for LLM pre-training, from raw corpora to torchrun.

`import shardkit` stays light: torch and the loaders load only when one of their names is used.
"""

from __future__ import annotations

from shardkit.lazy import lazy_names

__version__ = "0.1.0"

# Public name -> module that defines it. Resolved on first use (PEP 562) so that the CLI's
# `inspect` and the build never pay for importing torch.
_LAZY_NAMES = {
    "StreamingDataset": "shardkit.loaders.dataset",
    "StreamingDataLoader": "shardkit.loaders.dataloader",
    "Stream": "shardkit.loaders.order.mixing",
    "Schedule": "shardkit.loaders.order.schedule",
    "LoaderConfig": "shardkit.loaders.config",
    "Manifest": "shardkit.manifest",
    "ShardInfo": "shardkit.shard_info",
    "TokenizerInfo": "shardkit.manifest",
    "load_manifest": "shardkit.manifest",
    "ShardWriter": "shardkit.formats.writer",
    "ShardReader": "shardkit.formats.reader",
    "Sample": "shardkit.formats.sample",
    "CorruptShardError": "shardkit.errors",
}

__all__ = ["__version__", *_LAZY_NAMES]

__getattr__, __dir__ = lazy_names(__name__, _LAZY_NAMES, globals())
