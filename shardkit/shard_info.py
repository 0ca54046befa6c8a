"""`ShardInfo`: one shard as the manifest records it (its name, counts, SHA-256 and block index).

Its own module because both the manifest (`shardkit.manifest`, a list of them) and the binary index's
columns (`shardkit.shard_columns`, which make one for each shard a reader touches) build them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from shardkit.errors import ManifestError
from shardkit.names import check_relative_name


@dataclass(frozen=True, kw_only=True)
class ShardInfo:
    """One shard as the manifest records it.

    Attributes:
        name: path relative to the dataset prefix.
        samples: number of samples.
        tokens: number of tokens over all samples.
        compressed_bytes: size of the shard file as stored.
        raw_bytes: size of its payload before compression (docs/FORMAT.md defines it per format).
        sha256: SHA-256 hex digest of the shard file as stored.
        has_doc_boundaries: whether per-sample document boundaries and provenance are stored.
        index_offset, index_bytes, index_sha256: format version 2 only (None in version 1, and for an
            empty shard): where the shard's block index lies in the file and its SHA-256, which lets a
            reader verify and decode one block at a time (`shardkit.formats.blocks`).
    """

    name: str
    samples: int
    tokens: int
    compressed_bytes: int
    raw_bytes: int
    sha256: str
    has_doc_boundaries: bool
    index_offset: int | None = None
    index_bytes: int | None = None
    index_sha256: str | None = None

    @property
    def has_block_index(self) -> bool:
        """Whether the shard carries a block index (format v2: verified ranged reads of single blocks)."""
        return self.index_sha256 is not None

    def __post_init__(self) -> None:
        check_relative_name(self.name, what="shard name")
        index = (self.index_offset, self.index_bytes, self.index_sha256)
        if any(v is not None for v in index):
            if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in index[:2]) or not _is_sha256(index[2]):
                raise ManifestError(f"shard {self.name}: index_offset, index_bytes and index_sha256 must be given "
                                    "together (two non-negative integers and 64 lowercase hex digits)")
        for label in ("samples", "tokens", "compressed_bytes", "raw_bytes"):
            value = getattr(self, label)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
                raise ManifestError(f"shard {self.name}: {label} must be a non-negative integer below 2^63, got {value!r}")
        if not _is_sha256(self.sha256):
            raise ManifestError(f"shard {self.name}: sha256 must be 64 lowercase hex digits")

    def to_dict(self) -> dict[str, Any]:
        """The manifest entry; a version 1 shard has no index fields at all."""
        return {k: v for k, v in asdict(self).items() if v is not None or not k.startswith("index_")}


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
