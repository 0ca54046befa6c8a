"""Sources behind the Source contract (`shardkit.loaders.source`): built shards, raw text, their mixture."""
