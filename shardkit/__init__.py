"""shardkit: tokenized-shard datasets for LLM pre-training, from raw corpora to torchrun.

`import shardkit` stays light: torch and the loaders load only when one of their names is used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public name -> module that defines it. Resolved on first use (PEP 562) so that the CLI's
# `inspect` and the build never pay for importing torch.
_LAZY_NAMES = {
    "StreamingDataset": "shardkit.loaders.dataset",
    "StreamingDataLoader": "shardkit.loaders.dataloader",
    "Stream": "shardkit.loaders.mixing",
    "Schedule": "shardkit.loaders.schedule",
    "LoaderConfig": "shardkit.loaders.config",
    "Manifest": "shardkit.manifest",
    "ShardInfo": "shardkit.manifest",
    "TokenizerInfo": "shardkit.manifest",
    "load_manifest": "shardkit.manifest",
    "ShardWriter": "shardkit.formats.writer",
    "ShardReader": "shardkit.formats.reader",
    "Sample": "shardkit.formats.sample",
    "CorruptShardError": "shardkit.errors",
}

__all__ = ["__version__", *_LAZY_NAMES]


def __getattr__(name: str) -> Any:
    module_name = _LAZY_NAMES.get(name)
    if module_name is None:
        raise AttributeError(f"module 'shardkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
