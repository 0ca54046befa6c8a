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

import json
import logging
import os
import uuid
from dataclasses import asdict, dataclass

import numpy as np

from shardkit.formats import ShardArrays, ShardReader, read_shard
from shardkit.manifest import load_manifest
from shardkit.storage import Storage, open_filesystem
from shardkit.tools.convert.config import ExportConfig
from shardkit.tools.convert.megatron import METADATA_SUFFIX, encode_index, export_dtype

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


class _Output:
    """A file written whole or not at all: a local file goes to a temporary name and is renamed on success
    (an object store publishes an object only when its upload completes)."""

    def __init__(self, fs, path: str):
        self.fs, self.path = fs, path
        self.local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
        self.target = f"{path}.tmp-{uuid.uuid4().hex}" if self.local else path

    def __enter__(self):
        if self.local:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self.file = self.fs.open(self.target, "wb")
        return self.file

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and self.local:
            self.file.flush()
            os.fsync(self.file.fileno())
        self.file.close()
        if self.local:
            if exc_type is None:
                os.replace(self.target, self.path)
            elif os.path.exists(self.target):
                os.unlink(self.target)


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
    with _Output(fs, prefix + ".bin") as out:
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
    with _Output(fs, prefix + ".idx") as out:
        out.write(encode_index(dtype, documents, np.arange(len(documents) + 1)))
    metadata = {"tokenizer": asdict(manifest.tokenizer), "dataset": storage.display_url,
                "fingerprint": manifest.build.get("fingerprint"), "unit": config.unit}
    with _Output(fs, prefix + METADATA_SUFFIX) as out:
        out.write((json.dumps(metadata, indent=1, sort_keys=True) + "\n").encode())
    return ExportResult(prefix=config.output, documents=len(documents), tokens=tokens_written, dtype=dtype.name)
