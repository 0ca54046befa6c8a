"""The dataset manifest: one JSON file, `shardkit.json`, at the dataset prefix.

It is the single source of truth about a dataset: format, token dtype, sequence length, packing,
tokenizer identity, every shard with its counts and SHA-256, totals, and the build configuration.
It is written last and atomically, so a reader never sees a manifest that names a missing or
partial shard. The exact format is documented in docs/FORMAT.md.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from shardkit.errors import ManifestError
from shardkit.names import check_relative_name
from shardkit.storage import Storage, http_answer

MANIFEST_NAME = "shardkit.json"
# Far above a real manifest's depth (about 4), far below what recursive JSON code can take.
MAX_NESTING = 64
FORMAT_VERSION = 2  # what the writer produces when shards carry block indexes (docs/FORMAT.md)
FORMAT_VERSIONS = (1, 2)  # what this reader accepts
SHARD_FORMATS = ("tar", "arrow")
TOKEN_DTYPES = ("uint16", "uint32")
PACKING_MODES = ("concat", "bestfit", "none", "custom")
HASH_ALGORITHM = "sha256"


def token_dtype_for_vocab(vocab_size: int) -> str:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size <= 2**16:
        return "uint16"
    if vocab_size <= 2**32:
        return "uint32"
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32 token ids")


@dataclass(frozen=True, kw_only=True)
class TokenizerInfo:
    """Identity of the tokenizer that produced the token ids.

    Attributes:
        kind: "byte", "hf", "tiktoken", "sentencepiece" or another loader name.
        name: human-readable name (file name or registry name).
        vocab_size: number of ids, specials included (every id is < vocab_size).
        eos_id: id placed between documents, or None.
        bos_id: id placed before each document, or None.
        pad_id: id used to pad samples, or None.
        special_ids: other special tokens, name -> id.
        vocab_sha256: SHA-256 of the vocabulary file, or None for built-in tokenizers.
    """

    kind: str
    name: str
    vocab_size: int
    eos_id: int | None = None
    bos_id: int | None = None
    pad_id: int | None = None
    special_ids: dict[str, int] = field(default_factory=dict)
    vocab_sha256: str | None = None

    def __post_init__(self) -> None:
        if self.vocab_size <= 0:
            raise ManifestError(f"tokenizer.vocab_size must be positive, got {self.vocab_size}")
        for label, value in (("eos_id", self.eos_id), ("bos_id", self.bos_id), ("pad_id", self.pad_id),
                             *self.special_ids.items()):
            if value is not None and not 0 <= value < self.vocab_size:
                raise ManifestError(f"tokenizer {label}={value} is outside the vocabulary [0, {self.vocab_size})")


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
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ManifestError(f"shard {self.name}: {label} must be a non-negative integer, got {value!r}")
        if not _is_sha256(self.sha256):
            raise ManifestError(f"shard {self.name}: sha256 must be 64 lowercase hex digits")

    def to_dict(self) -> dict[str, Any]:
        """The manifest entry; a version 1 shard has no index fields at all."""
        return {k: v for k, v in asdict(self).items() if v is not None or not k.startswith("index_")}


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """Everything a reader needs to know about a dataset.

    Attributes:
        shard_format: "tar" or "arrow".
        token_dtype: "uint16" or "uint32".
        seq_len: training context length; packed samples hold seq_len + 1 tokens. None for
            variable-length data (`packing="none"`), where `max_sample_tokens` bounds a sample.
        packing: "concat", "bestfit", "none" or "custom".
        tokenizer: identity of the tokenizer.
        shards: the shards, in dataset order (global sample ids follow this order).
        sources: input names that provenance `doc_source` values index.
        compression: {"codec": "zstd", "level": N}.
        build: the build configuration (free-form JSON object).
        max_sample_tokens: longest sample allowed (seq_len + 1 for packed data).
        shardkit_version: version of the writer.
        format_version: version of this manifest format: 2 when any shard has a block index, else 1
            (derived when not given).
    """

    shard_format: str
    token_dtype: str
    seq_len: int | None
    packing: str
    tokenizer: TokenizerInfo
    shards: tuple[ShardInfo, ...]
    sources: tuple[str, ...] = ()
    compression: dict[str, Any] = field(default_factory=lambda: {"codec": "zstd", "level": 3})
    build: dict[str, Any] = field(default_factory=dict)
    max_sample_tokens: int | None = None
    shardkit_version: str = ""
    format_version: int | None = None

    def __post_init__(self) -> None:
        if self.format_version is None:
            indexed = any(isinstance(s, ShardInfo) and s.has_block_index for s in self.shards)
            object.__setattr__(self, "format_version", 2 if indexed else 1)
        if self.format_version not in FORMAT_VERSIONS:
            raise ManifestError(f"manifest format_version {self.format_version} is not supported "
                                f"(this shardkit reads versions {', '.join(map(str, FORMAT_VERSIONS))}); "
                                "upgrade shardkit")
        if self.shard_format not in SHARD_FORMATS:
            raise ManifestError(f"shard_format must be one of {SHARD_FORMATS}, got {self.shard_format!r}")
        if self.token_dtype not in TOKEN_DTYPES:
            raise ManifestError(f"token_dtype must be one of {TOKEN_DTYPES}, got {self.token_dtype!r}")
        if self.packing not in PACKING_MODES:
            raise ManifestError(f"packing must be one of {PACKING_MODES}, got {self.packing!r}")
        for label in ("seq_len", "max_sample_tokens"):
            value = getattr(self, label)
            # bool is an int subclass, and a float would be silently truncated by int(): both are errors.
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ManifestError(f"{label} must be a positive integer{' or variable' if label == 'seq_len' else ''}, "
                                    f"got {value!r}")
        if self.tokenizer.vocab_size > 2**16 and self.token_dtype == "uint16":
            raise ManifestError(f"vocab_size {self.tokenizer.vocab_size} needs uint32 token ids, manifest says uint16")
        if not self.shardkit_version:
            from shardkit import __version__
            object.__setattr__(self, "shardkit_version", __version__)
        # JSON gives lists and dicts of anything: check shapes here so a malformed manifest fails with
        # a ManifestError naming the field (a string `sources` would otherwise become its characters).
        if not isinstance(self.tokenizer, TokenizerInfo):
            raise ManifestError(f"tokenizer must be a TokenizerInfo, got {type(self.tokenizer).__name__}")
        if isinstance(self.shards, (str, bytes, dict)) or not all(isinstance(s, ShardInfo) for s in self.shards):
            raise ManifestError("shards must be a list of shard entries")
        if isinstance(self.sources, (str, bytes, dict)) or not all(isinstance(s, str) for s in self.sources):
            raise ManifestError(f"sources must be a list of strings, got {self.sources!r:.80}")
        for label in ("compression", "build"):
            if not isinstance(getattr(self, label), dict):
                raise ManifestError(f"{label} must be a JSON object, got {getattr(self, label)!r:.80}")
        object.__setattr__(self, "shards", tuple(self.shards))
        object.__setattr__(self, "sources", tuple(self.sources))
        if self.max_sample_tokens is None and self.seq_len is not None:
            object.__setattr__(self, "max_sample_tokens", self.seq_len + 1)
        if self.format_version == 1 and any(s.has_block_index for s in self.shards):
            raise ManifestError("a format_version 1 manifest cannot hold block indexes (index_* fields: version 2)")
        names = [s.name for s in self.shards]
        if len(set(names)) != len(names):
            raise ManifestError("manifest names the same shard twice")
        if MANIFEST_NAME in names:
            raise ManifestError(f"a shard may not be called {MANIFEST_NAME}")

    # -- derived -------------------------------------------------------------------------------
    @property
    def sample_length(self) -> int | None:
        """Tokens per sample for fixed-length (packed) data, None when variable."""
        return None if self.seq_len is None or self.packing == "none" else self.seq_len + 1

    @property
    def num_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    def totals(self) -> dict[str, int]:
        return {
            "shards": len(self.shards),
            "samples": self.num_samples,
            "tokens": self.num_tokens,
            "compressed_bytes": sum(s.compressed_bytes for s in self.shards),
            "raw_bytes": sum(s.raw_bytes for s in self.shards),
        }

    def with_shards(self, shards: Sequence[ShardInfo]) -> Manifest:
        return replace(self, shards=tuple(shards))

    # -- JSON --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "shardkit",
            "format_version": self.format_version,
            "shardkit_version": self.shardkit_version,
            "shard_format": self.shard_format,
            "token_dtype": self.token_dtype,
            "seq_len": "variable" if self.seq_len is None else self.seq_len,
            "max_sample_tokens": self.max_sample_tokens,
            "packing": self.packing,
            "tokenizer": asdict(self.tokenizer),
            "compression": dict(self.compression),
            "hash": HASH_ALGORITHM,
            "totals": self.totals(),
            "shards": [s.to_dict() for s in self.shards],
            "sources": list(self.sources),
            "build": self.build,
        }

    def to_json(self) -> str:
        """Deterministic JSON: the same manifest always gives the same bytes."""
        return json.dumps(self.to_dict(), indent=1, sort_keys=True, ensure_ascii=False) + "\n"

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "manifest") -> Manifest:
        if not isinstance(data, dict):
            raise ManifestError(f"{source}: expected a JSON object")
        if data.get("format") != "shardkit":
            raise ManifestError(f"{source}: not a shardkit manifest (field 'format' is {data.get('format')!r})")
        if data.get("hash", HASH_ALGORITHM) != HASH_ALGORITHM:
            raise ManifestError(f"{source}: unsupported hash {data.get('hash')!r}")
        try:
            seq_len = data["seq_len"]
            shards = tuple(ShardInfo(**s) for s in data["shards"])
            manifest = cls(
                format_version=data["format_version"],
                shardkit_version=data.get("shardkit_version", ""),
                shard_format=data["shard_format"],
                token_dtype=data["token_dtype"],
                seq_len=None if seq_len == "variable" else seq_len,
                max_sample_tokens=data.get("max_sample_tokens"),
                packing=data["packing"],
                tokenizer=TokenizerInfo(**data["tokenizer"]),
                compression=data.get("compression", {"codec": "zstd"}),
                shards=shards,
                sources=data.get("sources", ()),
                build=data.get("build", {}),
            )
        except ManifestError as err:
            raise ManifestError(f"{source}: {err}") from err
        except (KeyError, TypeError, ValueError) as err:
            raise ManifestError(f"{source}: malformed manifest ({type(err).__name__}: {err})") from err
        if manifest.compression.get("codec") != "zstd":
            raise ManifestError(f"{source}: unsupported compression {manifest.compression!r}")
        totals = data.get("totals")
        if totals is not None and totals != manifest.totals():
            raise ManifestError(f"{source}: totals {totals} do not match the sum over shards {manifest.totals()}")
        return manifest

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "manifest") -> Manifest:
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ManifestError(f"{source}: not valid JSON ({err})") from err
        except RecursionError:
            # json's decoder recurses once per level: a hostile file nested thousands deep exhausts the stack.
            raise ManifestError(f"{source}: JSON nested too deeply (a manifest has at most "
                                f"{MAX_NESTING} levels)") from None
        if _nesting_depth(data) > MAX_NESTING:
            # Parsed, but deep enough that later recursive walks (to_dict, json.dumps) could overflow.
            raise ManifestError(f"{source}: JSON nested more than {MAX_NESTING} levels deep")
        return cls.from_dict(data, source=source)


def _nesting_depth(data: Any) -> int:
    """Deepest level of lists and objects in parsed JSON, counted without recursion."""
    deepest, pending = 0, [(data, 1)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, depth)
            pending.extend((item, depth + 1) for item in (value.values() if isinstance(value, dict) else value))
    return deepest


def load_manifest(source: str | Storage, storage_options: dict[str, Any] | None = None) -> Manifest:
    """Read and validate the manifest of the dataset at `source` (a URL or a `Storage`)."""
    storage = source if isinstance(source, Storage) else Storage(source, storage_options)
    try:
        text = storage.read_bytes(MANIFEST_NAME)
    except FileNotFoundError as err:
        raise ManifestError(f"no dataset at {storage.display_url}: {MANIFEST_NAME} not found "
                            f"(was the build interrupted before it finished?){http_answer(err)}") from err
    return Manifest.from_json(text, source=storage.url_of(MANIFEST_NAME))


def write_manifest(storage: Storage, manifest: Manifest) -> None:
    """Publish the manifest atomically. Call it only after every shard it names is written."""
    storage.write_bytes(MANIFEST_NAME, manifest.to_json().encode())
