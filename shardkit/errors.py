"""Exceptions shared by every part of shardkit.

They subclass builtins so callers can catch `ValueError` / `OSError` without knowing shardkit.
"""

from __future__ import annotations


class CorruptShardError(ValueError):
    """A shard's bytes do not match what the manifest promises (hash, counts, structure)."""

    def __init__(self, shard: str, reason: str):
        self.shard = shard
        self.reason = reason
        super().__init__(f"corrupt shard {shard}: {reason}")


class UnsafeNameError(ValueError):
    """A name from a manifest or a tar member would resolve outside its prefix or cache directory."""


class ManifestError(ValueError):
    """A manifest is missing, malformed, or inconsistent with itself."""


class StorageError(OSError):
    """A storage operation failed for good (after retries, or with a non-transient cause)."""
