"""The dataset manifest: one JSON file, `shardkit.json`, at the dataset prefix.

It is the single source of truth about a dataset: format, token dtype, sequence length, packing,
tokenizer identity, every shard with its counts and SHA-256, totals, and the build configuration.
It is written last and atomically, so a reader never sees a manifest that names a missing or
partial shard. The exact format is documented in docs/FORMAT.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from shardkit.block_indexes import BLOCK_INDEXES_NAME, write_block_indexes
from shardkit.errors import ManifestError
from shardkit.hashing import read_pieces, sha256_pieces
from shardkit.shard_columns import INDEX_NAME, ShardColumns, decode_index, encode_index, map_index_file
from shardkit.shard_info import ShardInfo
from shardkit.storage import Storage, http_answer

logger = logging.getLogger(__name__)

MANIFEST_NAME = "shardkit.json"
RESERVED_NAMES = (MANIFEST_NAME, INDEX_NAME, BLOCK_INDEXES_NAME)
# Far above a real manifest's depth (about 4), far below what recursive JSON code can take.
MAX_NESTING = 64
# Manifest versions (docs/FORMAT.md): 1 the original; 2 adds block indexes; 3 lets tar shards use the group
# layout (`shardkit.formats.tar_blocks`), which readers of 1 and 2 do not parse. A version says what a reader
# must understand, so a reader that meets a later one refuses the dataset by its number, before any shard.
FORMAT_VERSION = 3  # what the writer produces for tar shards with block indexes in the group layout
FORMAT_VERSIONS = (1, 2, 3)  # what this reader accepts
SHARD_FORMATS = ("tar", "arrow")
TOKEN_DTYPES = ("uint16", "uint32")
PACKING_MODES = ("concat", "bestfit", "none", "custom")
HASH_ALGORITHM = "sha256"
# Bounds on what a manifest may declare (see `check_counts`). A shard is read whole into memory,
# so a declared size of a TiB is a corrupt or hostile manifest, never a real shard.
MAX_SHARD_BYTES = 2**40
# zstd's densest encoding is an RLE block: a 3-byte block header and 1 byte that decode to a whole
# block of at most 128 KiB, i.e. 4 bytes -> 131,072 bytes. Every other block type (raw, compressed
# with at least a literals header, a sequences header and a bitstream) decodes fewer bytes per
# stored byte, and frame headers only lower the ratio. So no stored byte decodes to more than 32,768
# bytes: raw_bytes (decoded payload, both formats) <= 32,768 x compressed_bytes.
MAX_ZSTD_RATIO = 131072 // 4
# A tar sample is at least its 8-byte entry in its group's sample_offsets .npy, which counts in raw_bytes
# (FORMAT.md section 4: group layout; a per-sample layout sample costs a 64-byte .npy header, more). The
# manifest does not say which layout a shard has, so the looser bound holds for both.
MIN_TAR_SAMPLE_RAW_BYTES = 8
# An arrow sample is at least its 4-byte list offset, which raw_bytes counts (FORMAT.md section 5).
MIN_ARROW_SAMPLE_RAW_BYTES = 4
# Positions, steps and totals are int64: totals stay far below its limit.
MAX_TOTAL = 2**62
_TOKEN_BYTES = {"uint16": 2, "uint32": 4}
_DIGEST_CHUNK = 1 << 24  # per ranged read of a remote JSON
# From this many shards the build writes the binary index (JSON parsing costs ~20 us per shard).
INDEX_MIN_SHARDS = 10_000


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
        format_version: version of this manifest format (derived when not given): 1 without block indexes,
            2 with them, 3 when tar shards may be in the group layout (what `ShardWriter` writes by default;
            a writer of per-sample layout tar shards passes 2, which older readers also read).
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
            indexed = (self.shards.has_block_index.any() if isinstance(self.shards, ShardColumns)
                       else any(isinstance(s, ShardInfo) and s.has_block_index for s in self.shards))
            version = (3 if self.shard_format == "tar" else 2) if indexed else 1
            object.__setattr__(self, "format_version", version)
        check_format_version(self.format_version, source="manifest")
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
        columnar = isinstance(self.shards, ShardColumns)  # checked column-wise where it was read
        if not columnar and (isinstance(self.shards, (str, bytes, dict))
                             or not all(isinstance(s, ShardInfo) for s in self.shards)):
            raise ManifestError("shards must be a list of shard entries")
        if isinstance(self.sources, (str, bytes, dict)) or not all(isinstance(s, str) for s in self.sources):
            raise ManifestError(f"sources must be a list of strings, got {self.sources!r:.80}")
        for label in ("compression", "build"):
            if not isinstance(getattr(self, label), dict):
                raise ManifestError(f"{label} must be a JSON object, got {getattr(self, label)!r:.80}")
        if not columnar:
            object.__setattr__(self, "shards", tuple(self.shards))
        object.__setattr__(self, "sources", tuple(self.sources))
        if self.max_sample_tokens is None and self.seq_len is not None:
            object.__setattr__(self, "max_sample_tokens", self.seq_len + 1)
        if columnar:
            indexed = self.shards.has_block_index.any()
            reserved = [n for n in RESERVED_NAMES if self.shards.find(n) is not None]
        else:
            indexed = any(s.has_block_index for s in self.shards)
            names = [s.name for s in self.shards]
            if len(set(names)) != len(names):
                raise ManifestError("manifest names the same shard twice")
            reserved = [n for n in RESERVED_NAMES if n in set(names)]
        if self.format_version == 1 and indexed:
            raise ManifestError("a format_version 1 manifest cannot hold block indexes (index_* fields: version 2)")
        if reserved:
            raise ManifestError(f"a shard may not be called {reserved[0]}")

    # -- derived -------------------------------------------------------------------------------
    @property
    def sample_length(self) -> int | None:
        """Tokens per sample for fixed-length (packed) data, None when variable."""
        return None if self.seq_len is None or self.packing == "none" else self.seq_len + 1

    @property
    def columns(self) -> ShardColumns:
        """The shards as numpy columns (`columns.samples`, ...): what readers of many shards use."""
        if isinstance(self.shards, ShardColumns):
            return self.shards
        cached = self.__dict__.get("_columns")
        if cached is None or len(cached) != len(self.shards):
            cached = ShardColumns.from_shards(self.shards)
            object.__setattr__(self, "_columns", cached)
        return cached

    def _sum(self, field_name: str) -> int:
        if isinstance(self.shards, ShardColumns):  # bounded by check_counts: the int64 sum is exact
            return int(np.sum(getattr(self.shards, field_name)))
        return sum(getattr(s, field_name) for s in self.shards)

    @property
    def num_samples(self) -> int:
        """Samples in all shards."""
        return self._sum("samples")

    @property
    def num_tokens(self) -> int:
        """Tokens in all samples (padding included)."""
        return self._sum("tokens")

    def totals(self) -> dict[str, int]:
        """The manifest's `totals` record: shards, samples, tokens, compressed and raw bytes, summed over shards."""
        return {
            "shards": len(self.shards),
            "samples": self.num_samples,
            "tokens": self.num_tokens,
            "compressed_bytes": self._sum("compressed_bytes"),
            "raw_bytes": self._sum("raw_bytes"),
        }

    def with_shards(self, shards: Sequence[ShardInfo]) -> Manifest:
        """A copy of this manifest listing `shards` instead (e.g. after a build appended some)."""
        return replace(self, shards=tuple(shards))

    # -- JSON --------------------------------------------------------------------------------
    def to_dict(self, *, with_shards: bool = True) -> dict[str, Any]:
        """The manifest as the JSON object of `shardkit.json` (docs/FORMAT.md).

        Args:
            with_shards: include the `shards` list (False: only the dataset-level fields and totals).
        """
        data = {
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
            "shards": [s.to_dict() for s in self.shards] if with_shards else None,
            "sources": list(self.sources),
            "build": self.build,
        }
        if not with_shards:
            del data["shards"]
        return data

    def to_json(self) -> str:
        """Deterministic JSON: the same manifest always gives the same bytes."""
        return json.dumps(self.to_dict(), indent=1, sort_keys=True, ensure_ascii=False) + "\n"

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "manifest") -> Manifest:
        """The manifest of a parsed `shardkit.json` object, checked (counts, totals, names, tokenizer).

        Args:
            data: the parsed JSON object.
            source: what error messages call it (the file's URL).

        Raises:
            ManifestError: the object is not a shardkit manifest, is malformed or inconsistent.
        """
        if not isinstance(data, dict):
            raise ManifestError(f"{source}: expected a JSON object")
        _check_kind(data, source)
        try:
            shards = tuple(ShardInfo(**s) for s in data["shards"])
        except ManifestError as err:
            raise ManifestError(f"{source}: {err}") from err
        except (KeyError, TypeError, ValueError) as err:
            raise ManifestError(f"{source}: malformed manifest ({type(err).__name__}: {err})") from err
        return cls._from_fields(data, shards, source=source)

    @classmethod
    def _from_fields(cls, data: dict[str, Any], shards: tuple[ShardInfo, ...] | ShardColumns, *,
                     source: str) -> Manifest:
        """The manifest of the JSON fields `data` (its "shards" entry ignored) and `shards`, checked."""
        _check_kind(data, source)
        try:
            seq_len = data["seq_len"]
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
        check_counts(manifest, source=source)
        totals = data.get("totals")
        if totals is not None and totals != manifest.totals():
            raise ManifestError(f"{source}: totals {totals} do not match the sum over shards {manifest.totals()}")
        return manifest

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "manifest") -> Manifest:
        """`from_dict` of a `shardkit.json` text.

        Args:
            text: the JSON text (str or UTF-8 bytes).
            source: what error messages call it (the file's URL).

        Raises:
            ManifestError: not valid JSON, or as `from_dict`.
        """
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


def check_format_version(version: Any, *, source: str) -> None:
    """Refuse a manifest version this reader does not know, naming `source`: a later one as written by a newer
    shardkit (never as corrupt: its shards may be laid out in ways this reader cannot parse)."""
    if version in FORMAT_VERSIONS:
        return
    if isinstance(version, int) and not isinstance(version, bool) and version > max(FORMAT_VERSIONS):
        raise ManifestError(f"{source}: written by a newer shardkit (format {version}; this shardkit reads formats "
                            f"{', '.join(map(str, FORMAT_VERSIONS))}); upgrade shardkit")
    raise ManifestError(f"{source}: format_version {version!r} is not supported (this shardkit reads "
                        f"{', '.join(map(str, FORMAT_VERSIONS))}); the manifest is corrupt or was edited")


def _check_kind(data: dict[str, Any], source: str) -> None:
    if data.get("format") != "shardkit":
        raise ManifestError(f"{source}: not a shardkit manifest (field 'format' is {data.get('format')!r})")
    # Before anything else is parsed: a later version's shards may carry fields this reader calls malformed.
    if "format_version" in data:
        check_format_version(data["format_version"], source=source)
    if data.get("hash", HASH_ALGORITHM) != HASH_ALGORITHM:
        raise ManifestError(f"{source}: unsupported hash {data.get('hash')!r}")


def _nesting_depth(data: Any) -> int:
    """Deepest level of lists and objects in parsed JSON, counted without recursion."""
    deepest, pending = 0, [(data, 1)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, depth)
            pending.extend((item, depth + 1) for item in (value.values() if isinstance(value, dict) else value))
    return deepest


def check_counts(manifest: Manifest, *, source: str) -> None:
    """Refuse declared counts that no shard of the declared size could hold, before anything is planned.

    A manifest is read before any shard, so its counts decide how much the loader plans; these
    bounds (see the constants above) tie each shard's samples and tokens to its stored size, so a
    manifest claiming 1e15 samples fails here, in milliseconds, naming the shard, instead of
    sizing a plan on them. The shard's real size is then checked against `compressed_bytes` on the
    first read of it (`shardkit.formats.fetch`).

    Raises:
        ManifestError: naming `source`, the first offending shard and what it declares.
    """
    c = manifest.columns
    if not len(c):
        return
    samples, tokens, stored, raw = c.samples, c.tokens, c.compressed_bytes, c.raw_bytes
    # Every bound is written with divisions, not products, so no int64 overflows whatever is declared.
    rules = [
        (stored > MAX_SHARD_BYTES, f"compressed_bytes above {MAX_SHARD_BYTES:,} (a shard is read whole into memory)"),
        (-(-raw // MAX_ZSTD_RATIO) > stored, f"raw_bytes more than {MAX_ZSTD_RATIO:,} x compressed_bytes "
                                              "(zstd's maximum ratio)"),
        (tokens > raw // _TOKEN_BYTES[manifest.token_dtype], f"more {manifest.token_dtype} tokens than raw_bytes hold"),
    ]
    if manifest.shard_format == "tar":
        rules.append((samples > raw // MIN_TAR_SAMPLE_RAW_BYTES,
                      f"more samples than raw_bytes / {MIN_TAR_SAMPLE_RAW_BYTES} (a tar sample's offset entry)"))
    else:
        rules.append((samples > raw // MIN_ARROW_SAMPLE_RAW_BYTES,
                      f"more samples than raw_bytes / {MIN_ARROW_SAMPLE_RAW_BYTES} (an arrow sample's list offset)"))
    length = manifest.sample_length
    if length is not None:
        rules.append(((tokens % length != 0) | (tokens // length != samples),
                      f"tokens != samples x {length} (every sample holds seq_len + 1 tokens)"))
    elif manifest.max_sample_tokens is not None:
        rules.append((-(-tokens // manifest.max_sample_tokens) > samples,
                      f"more tokens than samples x max_sample_tokens ({manifest.max_sample_tokens})"))
    first, reason = min(((int(np.argmax(bad)), why) for bad, why in rules if bad.any()), default=(None, ""),
                        key=lambda item: item[0])
    if first is not None:
        raise ManifestError(f"{source}: shard {c.name(first)} declares {int(samples[first])} samples, "
                            f"{int(tokens[first])} tokens, {int(raw[first])} raw bytes in {int(stored[first])} "
                            f"compressed bytes: {reason}; the manifest is corrupt or was edited, rebuild it")
    for label, column in (("samples", samples), ("tokens", tokens), ("raw_bytes", raw), ("compressed_bytes", stored)):
        if float(np.sum(column, dtype=np.float64)) > MAX_TOTAL:
            raise ManifestError(f"{source}: the shards declare more than 2^62 {label} in total; "
                                "the manifest is corrupt or was edited")


def load_manifest(source: str | Storage, storage_options: dict[str, Any] | None = None, *,
                  display_url: str | None = None, known_digest: tuple[int, str] | None = None,
                  index_copy: str | None = None, checked_index: str | None = None) -> Manifest:
    """Read and validate the manifest of the dataset at `source` (a URL or a `Storage`).

    When the build wrote a binary index (`shardkit.index`) and it records this very JSON (size and
    SHA-256, the JSON hashed in bounded memory), the shards are read from the index as columns:
    a million shards load in well under a second and a few hundred MB. Otherwise (older datasets,
    an index that is stale or damaged: logged) the JSON is parsed.

    Args:
        source: the dataset: a URL (local path or any fsspec URL) or an open `Storage`.
        storage_options: fsspec options for a URL `source` (e.g. an S3 endpoint); unused with a `Storage`.
        display_url: the URL that errors name (e.g. the store's, when `source` is a local copy).
        known_digest: the JSON's (size, SHA-256) when the caller has already computed it for this
            very file (the node cache does, once per node), so it is not read again.
        index_copy: a local copy of the dataset's index that nothing rewrites in place (the node
            cache's private one), memory-mapped instead of read (`map_index_file`); without it the
            dataset's own index is read whole.
        checked_index: `file_stamp` of `index_copy` when this node has already checked that very file
            (checksum and names: the node cache's record), so those checks are not repeated.

    Raises:
        ManifestError: the manifest is missing, malformed or inconsistent with itself (a `ValueError`).
        StorageError: the store cannot be read after retries (an `OSError`).
    """
    storage = source if isinstance(source, Storage) else Storage(source, storage_options)
    return _load(storage, display_url, known_digest, index_copy, checked_index, with_digest=False)[0]


def load_manifest_and_digest(storage: Storage, *, display_url: str | None = None, index_copy: str | None = None
                             ) -> tuple[Manifest, tuple[int, str], str | None]:
    """`load_manifest`, the JSON's (size, SHA-256) and the stamp of `index_copy` when the manifest was
    read from it (every check passed: what the node cache records once per node), else None.

    The JSON is hashed while the index is decoded and checked (hashlib and file reads release the
    GIL), or from the very bytes that are parsed when there is no usable index: never read twice.
    """
    return _load(storage, display_url, None, index_copy, None, with_digest=True)


def _load(storage: Storage, display_url: str | None, known_digest: tuple[int, str] | None, index_copy: str | None,
          checked_index: str | None, *, with_digest: bool) -> tuple[Manifest, tuple[int, str] | None, str | None]:
    url = display_url or storage.url_of(MANIFEST_NAME)
    if storage.is_local and os.path.isfile(storage.root):
        raise ManifestError(f"no dataset at {display_url or storage.display_url}: it is a file, and a dataset is the "
                            f"directory `shardkit build` wrote ({MANIFEST_NAME} and its shards); raw text is read "
                            "with a tokenizer (shardkit train --tokenizer SPEC, StreamingDataset(..., tokenizer=))")
    try:
        loaded = _load_indexed(storage, url, known_digest, index_copy, checked_index)
        if loaded is not None:
            return loaded
        text = storage.read_bytes(MANIFEST_NAME)
    except FileNotFoundError as err:
        where = url.rsplit("/", 1)[0] if display_url else storage.display_url
        raise ManifestError(f"no dataset at {where}: {MANIFEST_NAME} not found "
                            f"(was the build interrupted before it finished?){http_answer(err)}") from err
    digest = (len(text), hashlib.sha256(text).hexdigest()) if with_digest else None
    return Manifest.from_json(text, source=url), digest, None


def _load_indexed(storage: Storage, url: str, known_digest: tuple[int, str] | None, index_copy: str | None,
                  checked_index: str | None) -> tuple[Manifest, tuple[int, str], str | None] | None:
    """The manifest from its binary index, the JSON's (size, SHA-256) and the stamp of `index_copy`
    (None when the index was read from `storage`), or None when there is no usable index for this JSON."""
    # One read that may find nothing, not an existence check first: on an object store `exists` costs
    # a HEAD and a LIST for a missing key, on every open of every dataset without an index.
    index_url = url[:-len(MANIFEST_NAME)] + INDEX_NAME if url.endswith(MANIFEST_NAME) else INDEX_NAME
    try:
        if index_copy is not None:
            index_file, index_bytes = open(index_copy, "rb"), None
        else:
            index_file, index_bytes = contextlib.nullcontext(), storage.read_bytes(INDEX_NAME)
    except (FileNotFoundError, IsADirectoryError):
        return None
    # Hashing the JSON (~250 MB at a million shards) overlaps with decoding and checking the index:
    # hashlib and file reads release the GIL.
    with index_file, ThreadPoolExecutor(1, thread_name_prefix="shardkit-manifest-hash") as pool:
        pending = None if known_digest else pool.submit(json_digest, storage)
        try:
            if index_bytes is None:
                header, shards, stamp = map_index_file(index_file, source=index_url, checked_stamp=checked_index)
            else:
                (header, shards), stamp = decode_index(index_bytes, source=index_url), None
            if _nesting_depth(header) > MAX_NESTING:
                raise ManifestError(f"{index_url}: header nested more than {MAX_NESTING} levels deep")
        except ManifestError as err:
            logger.warning("%s; reading %s instead", err, url)
            return None
        problem = None
        if stamp is None or stamp != checked_index:
            try:
                shards.check(source=url)
            except ManifestError as err:
                problem = err  # reported only if the index is this JSON's (else the JSON decides)
        size, digest = known_digest or pending.result()
    recorded = header.get("index", {})
    if (size, digest) != (recorded.get("json_bytes"), recorded.get("json_sha256")):
        logger.warning("%s was not made from this %s (it was rewritten after the build); reading the JSON, "
                       "which is slow for many shards: rebuild the index with write_index", index_url, url)
        return None
    if problem is not None:
        raise problem
    return Manifest._from_fields(header, shards, source=url), (size, digest), stamp


def json_digest(storage: Storage) -> tuple[int, str]:
    """(size, SHA-256) of the manifest JSON, read in pieces (bounded memory)."""
    if storage.is_local:
        # One small buffer, refilled: this runs beside the index checks, whose peak memory it adds to.
        with open(storage.path(MANIFEST_NAME), "rb", buffering=0) as fh:
            size, digest = sha256_pieces(read_pieces(fh))
            return size, digest.hexdigest()
    total = storage.size(MANIFEST_NAME)
    size, digest = sha256_pieces(storage.read_range(MANIFEST_NAME, start, min(start + _DIGEST_CHUNK, total))
                                 for start in range(0, total, _DIGEST_CHUNK))
    return size, digest.hexdigest()


def write_manifest(storage: Storage, manifest: Manifest, *, index: bool | None = None) -> None:
    """Publish the manifest atomically. Call it only after every shard it names is written.

    Args:
        index: write the binary index beside it; None (default) when it has `INDEX_MIN_SHARDS` shards
            or more (below that the JSON parses in milliseconds and the dataset stays one file).

    The index goes first: a reader that sees the new JSON finds the index made from it; one that
    still sees the old JSON finds an index that does not match it and reads the JSON. So does the file of
    the shards' block indexes (`shardkit.block_indexes`, when they are small together): a reader takes from
    it only indexes whose SHA-256 the JSON it read records.
    """
    text = manifest.to_json().encode()
    write_block_indexes(storage, manifest.shards if manifest.format_version > 1 else ())
    if index if index is not None else len(manifest.shards) >= INDEX_MIN_SHARDS:
        _write_index(storage, manifest, text)
    elif storage.exists(INDEX_NAME):
        storage.delete(INDEX_NAME)  # made from an earlier manifest: it would only be read and refused
    storage.write_bytes(MANIFEST_NAME, text)


def write_index(source: str | Storage, storage_options: dict[str, Any] | None = None) -> None:
    """(Re)write the binary index of an existing dataset from its JSON (datasets built before it)."""
    storage = source if isinstance(source, Storage) else Storage(source, storage_options)
    text = storage.read_bytes(MANIFEST_NAME)
    _write_index(storage, Manifest.from_json(text, source=storage.url_of(MANIFEST_NAME)), text)


def _write_index(storage: Storage, manifest: Manifest, text: bytes) -> None:
    storage.write_bytes(INDEX_NAME, encode_index(manifest.to_dict(with_shards=False), manifest.columns,
                                                 json_bytes=text))
