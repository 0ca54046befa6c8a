"""Exceptions shared by every part of shardkit.

They subclass builtins so callers can catch `ValueError` / `OSError` without knowing shardkit.
"""

from __future__ import annotations


class CorruptShardError(ValueError):
    """A shard's bytes do not match what the manifest promises (hash, counts, structure).

    A `ValueError`, so callers that do not know shardkit still catch it; the message is
    "corrupt shard SHARD: REASON".

    Args:
        shard: the shard's name or URL.
        reason: what did not match (e.g. "sha256 is ..., the manifest says ...").

    Attributes:
        shard: the shard's name or URL, as given.
        reason: what did not match, as given.
    """

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
