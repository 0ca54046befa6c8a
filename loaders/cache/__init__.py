"""The node-local shard cache: stores per cache mode, the cache directory, block-by-block reading."""
