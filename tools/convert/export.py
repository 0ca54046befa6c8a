"""`shardkit export --to megatron`: a shardkit dataset as a Megatron indexed dataset.

Shards are read in manifest order with the loader's verified read (size and SHA-256 against the
manifest, every id against the vocabulary) and their tokens streamed to `PREFIX.bin`; `PREFIX.idx`
(layout in `megatron`) follows once every document's length is known, then `PREFIX.shardkit.json`
with the tokenizer identity, which `shardkit convert --from megatron` reads back. Each Megatron
document is one sequence.

Documents (`--unit document`) are rebuilt from the samples' segments: padding segments (source -1)
are dropped and adjacent segments of the same (source, document index) are joined, also across
samples and shards, so concat- and none-packed datasets give back exactly their source documents (a
bestfit-packed document longer than a window comes back as its full windows and, separately, its tail).
`--unit sample` writes each sample as stored, padding included.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import BinaryIO

import numpy as np

from shardkit.formats import ShardArrays, ShardReader, read_shard
from shardkit.manifest import load_manifest
from shardkit.storage import Storage, atomic_path, open_filesystem

from .config import ExportConfig
from .megatron import METADATA_SUFFIX, encode_index, export_dtype

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote: the .bin/.idx prefix, documents (= sequences) and tokens."""

    prefix: str
    documents: int
    tokens: int
    dtype: str


def documents_of(arrays: ShardArrays, *, unit: str) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """(tokens to write, the pieces' document keys (source, index), lengths of the pieces).

    Pieces are samples (`unit="sample"`, keys None: each is a document) or the non-padding segments
    (`"document"`); the caller joins adjacent pieces with equal keys into one document.
    """
    if unit == "sample":
        return arrays.tokens, None, np.diff(arrays.sample_offsets)
    segments_per_sample = np.diff(arrays.doc_offsets)
    owner = np.repeat(np.arange(arrays.num_samples), segments_per_sample)
    starts = arrays.sample_offsets[owner] + arrays.doc_starts
    ends = np.append(starts[1:], arrays.tokens.size)
    lengths = ends - starts
    keep = arrays.doc_source >= 0
    tokens = arrays.tokens if keep.all() else arrays.tokens[np.repeat(keep, lengths)]
    keys = np.stack([arrays.doc_source[keep], arrays.doc_index[keep]], axis=1).astype(np.int64)
    return tokens, keys, lengths[keep]


@contextlib.contextmanager
def _output(fs, path: str) -> Iterator[BinaryIO]:
    """A file written whole or not at all: a local file through the core's `atomic_path` (fsynced, renamed on
    success); an object store publishes an object only when its upload completes."""
    if "file" not in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        with fs.open(path, "wb") as fh:
            yield fh
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with atomic_path(path) as temporary, open(temporary, "xb") as fh:
        yield fh


def run_export(config: ExportConfig) -> ExportResult:
    """Write the dataset `config.dataset` as `config.output`.bin / .idx / .shardkit.json.

    Raises:
        ValueError: `--unit document` on a dataset without document boundaries, or a document too long.
        FileExistsError: the prefix's files exist and `overwrite` is false.
        CorruptShardError, OSError: a shard fails its check, storage failures.
    """
    from tqdm import tqdm

    storage = Storage(config.dataset, config.storage_options)
    manifest = load_manifest(storage)
    if config.unit == "document" and not all(s.has_doc_boundaries for s in manifest.shards):
        raise ValueError(f"{storage.display_url} stores no document boundaries; export it with --unit sample")
    dtype = export_dtype(manifest.tokenizer.vocab_size)
    fs, prefix = open_filesystem(config.output, config.storage_options)
    for suffix in (".bin", ".idx"):
        if fs.exists(prefix + suffix) and not config.overwrite:
            raise FileExistsError(f"--output {config.output}{suffix} exists; pass --overwrite to replace it")
    finished: list[np.ndarray] = []  # lengths of the documents known to be complete
    current: int | None = None  # length so far of the last document, which the next shard may continue
    last_key = None
    tokens_written = 0
    with _output(fs, prefix + ".bin") as out:
        for shard in tqdm(manifest.shards, desc="export", unit="shard", disable=not config.progress):
            reader = read_shard(storage, shard, decode=lambda data, shard=shard: ShardReader.from_bytes(
                data, shard=shard, manifest=manifest, verify=False))
            tokens, keys, pieces = documents_of(reader.arrays, unit=config.unit)
            out.write(tokens.astype(dtype).tobytes())
            tokens_written += int(tokens.size)
            if not len(pieces):
                continue
            new = np.ones(len(pieces), dtype=bool)
            if keys is not None:
                new[1:] = np.any(keys[1:] != keys[:-1], axis=1)
                new[0] = last_key is None or not np.array_equal(keys[0], last_key)
            starts = np.flatnonzero(new)
            if not new[0]:
                current += int(pieces[:starts[0] if len(starts) else len(pieces)].sum())
            if len(starts):
                sums = np.add.reduceat(pieces, starts)
                if current is not None:
                    finished.append(np.array([current]))
                finished.append(sums[:-1])
                current = int(sums[-1])
            last_key = None if keys is None else keys[-1]
    if current is not None:
        finished.append(np.array([current]))
    documents = np.concatenate(finished).astype(np.int64) if finished else np.zeros(0, dtype=np.int64)
    if documents.size and documents.max() >= 2**31:
        raise ValueError(f"a document of {int(documents.max())} tokens does not fit Megatron's int32 lengths")
    with _output(fs, prefix + ".idx") as out:
        out.write(encode_index(dtype, documents, np.arange(len(documents) + 1)))
    metadata = {"tokenizer": asdict(manifest.tokenizer), "dataset": storage.display_url,
                "fingerprint": manifest.build.get("fingerprint"), "unit": config.unit}
    with _output(fs, prefix + METADATA_SUFFIX) as out:
        out.write((json.dumps(metadata, indent=1, sort_keys=True) + "\n").encode())
    return ExportResult(prefix=config.output, documents=len(documents), tokens=tokens_written, dtype=dtype.name)
