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


class MissingExtraError(ImportError, ValueError):
    """An optional package a feature needs is not installed. An `ImportError` (what Python raises for it) and a
    `ValueError` (so the commands print it as one line, as any bad input): "WHAT needs the PACKAGE package: pip
    install 'shardkit[EXTRA]'".

    Args:
        what: the feature that asked for it (e.g. "--tokenizer tiktoken:cl100k_base").
        package: the module that is missing.
        extra: shardkit's extra that installs it.
    """

    def __init__(self, what: str, package: str, extra: str):
        super().__init__(f"{what} needs the {package!r} package, which is not installed: "
                         f"pip install 'shardkit[{extra}]'", name=package)


def optional_module(package: str, *, what: str, extra: str):
    """`import package`, or a `MissingExtraError` naming the extra that installs it."""
    import importlib

    try:
        return importlib.import_module(package)
    except ModuleNotFoundError as err:
        if err.name != package and not (err.name or "").startswith(package + "."):
            raise  # the package is there but something it imports is not: its own error says what
        raise MissingExtraError(what, package, extra) from err
