"""`ShardWriter`: write samples into size-limited shards on any fsspec URL.

Samples are buffered in memory until the shard reaches `max_samples` or `max_bytes` of raw
(uncompressed) data, then the shard is encoded, uploaded in one atomic put and reported to the
`on_shard_done` hook. The writer never writes a manifest: its caller does that last, once every
shard is in place (`write_dataset` shows the whole sequence).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from shardkit.formats.shard_bytes import SHARD_EXTENSIONS, encode_shard, manifest_version, shard_layout
from shardkit.formats.sample import (OFFSETS_DTYPE, Sample, ShardArrays, check_arrays, check_sample, concat_arrays,
                                     numpy_token_dtype)
from shardkit.manifest import Manifest, ShardInfo, TokenizerInfo, write_manifest
from shardkit.storage import Storage

DEFAULT_MAX_BYTES = 64 * 2**20


class ShardWriter:
    """Context manager that writes samples into rolling shards.

    Args:
        url: dataset prefix (any fsspec URL) or a `Storage`.
        shard_format: "tar" or "arrow".
        token_dtype: "uint16" or "uint32".
        max_samples: roll over after this many samples (None: no sample limit).
        max_bytes: roll over once a shard holds this many raw (uncompressed) payload bytes.
        compression_level: zstd level.
        name_template: shard file stem; `{index}` is the shard's sequence number.
        start_index: index of the first shard (lets a resumed build continue numbering).
        on_shard_done: called with each finished shard's `ShardInfo`.
        storage_options: fsspec options when `url` is a string.
        format_version: 2 (default) writes a block index into each shard so that readers can verify and
            decode one block before the shard is local; 1 writes the original format.
        block_bytes: raw bytes per block (format v2; tar member groups and Arrow record batches; default
            per format, `shardkit.formats.blocks.DEFAULT_BLOCK_BYTES`).
        encode_threads: shards encoded (compressed, hashed and stored) at once in background threads while
            the next shard fills; 0 encodes in the caller's thread. zstd and SHA-256 release the GIL, so
            this uses more cores; the shards' bytes do not depend on it. `on_shard_done` still runs in the
            caller's thread and in shard order. The arrays written are read until their shard is encoded
            (they are joined in the background): do not change them in place meanwhile.
        on_shard_cut: called with a shard's index when its samples are fixed, before it is encoded (with
            `encode_threads`, `on_shard_done` comes later, after the caller may have written more).
        tar_layout: "blocks" (default) stores each block of samples as one member group, compressed together
            (about Arrow's size; webdataset yields a record per block, `shardkit.formats.wds_samples` splits
            it); "samples" writes the earlier layout, a member per sample and field (several times larger),
            the default with format_version 1. Group layout shards need a version 3 manifest
            (`manifest_version`), which shardkit before the group layout refuses as newer.
    """

    def __init__(self, url: str | Storage, *, shard_format: str = "tar", token_dtype: str = "uint16",
                 max_samples: int | None = None, max_bytes: int | None = DEFAULT_MAX_BYTES,
                 compression_level: int = 3, name_template: str = "shard-{index:06d}", start_index: int = 0,
                 on_shard_done: Callable[[ShardInfo], None] | None = None,
                 storage_options: dict[str, Any] | None = None, format_version: int = 2,
                 block_bytes: int | None = None, encode_threads: int = 0,
                 on_shard_cut: Callable[[int], None] | None = None, tar_layout: str | None = None):
        tar_layout = shard_layout(format_version, tar_layout)
        if shard_format not in SHARD_EXTENSIONS:
            raise ValueError(f"shard_format must be 'tar' or 'arrow', got {shard_format!r}")
        numpy_token_dtype(token_dtype)
        if max_samples is not None and max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        if encode_threads < 0:
            raise ValueError(f"encode_threads must be >= 0, got {encode_threads}")
        self.storage = url if isinstance(url, Storage) else Storage(url, storage_options)
        self.shard_format = shard_format
        self.token_dtype = token_dtype
        self.max_samples = max_samples
        self.max_bytes = max_bytes
        self.compression_level = compression_level
        self.format_version = format_version
        self.block_bytes = block_bytes
        self.tar_layout = tar_layout
        self.name_template = name_template
        self.next_index = start_index
        self.on_shard_done = on_shard_done
        self.on_shard_cut = on_shard_cut
        self.encode_threads = encode_threads
        self._pool = ThreadPoolExecutor(encode_threads, thread_name_prefix="shard-encode") if encode_threads else None
        self._in_flight: deque[Future] = deque()  # shards being encoded, oldest first
        self.shards: list[ShardInfo] = []
        self._pending: list[ShardArrays] = []  # runs of samples of the shard being filled
        self._pending_samples = 0
        self._pending_bytes = 0
        self._itemsize = numpy_token_dtype(token_dtype).itemsize
        self._closed = False

    @property
    def manifest_version(self) -> int:
        """The `format_version` of a manifest that lists this writer's shards (3 for group layout tar)."""
        return manifest_version(self.shard_format, self.format_version, self.tar_layout)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # On error, do not publish a half-filled shard; what was finished stays finished.
        if exc_type is None:
            self.close()
        else:
            self._pending.clear()
            self._closed = True
            self._stop_encoding()

    def _stop_encoding(self) -> None:
        """Let shards being encoded finish (a thread cannot be stopped), without reporting them."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._in_flight.clear()

    def write(self, sample: Sample | np.ndarray) -> None:
        """Add one sample (a `Sample`, or its token ids); the shard is written once it is full.

        Raises:
            ValueError: the writer is closed, the sample's tokens do not fit the token dtype or its segments
                are inconsistent, or it has document boundaries where the shard's other samples have none
                (or the reverse).
        """
        self._check_open()
        if not isinstance(sample, Sample):
            sample = Sample(np.asarray(sample))
        sample = check_sample(sample, self.token_dtype,
                              what=f"sample {self._pending_samples} of shard {self.next_index} (written to {self.storage.url})")
        offsets = np.array([0, len(sample.tokens)], dtype=OFFSETS_DTYPE)
        if sample.has_doc_boundaries:
            arrays = ShardArrays(sample.tokens, offsets, np.array([0, len(sample.doc_starts)], dtype=OFFSETS_DTYPE),
                                 sample.doc_starts, sample.doc_source, sample.doc_index)
        else:
            arrays = ShardArrays(sample.tokens, offsets)
        self._add(arrays)

    def write_arrays(self, arrays: ShardArrays) -> None:
        """Add a run of samples at once (what `write` does for each, checked with array operations); shards
        roll over at the same samples as when they are written one by one.

        Raises:
            ValueError: as `write`, naming the run.
        """
        self._check_open()
        if arrays.num_samples:
            self._add(check_arrays(arrays, self.token_dtype, what=f"samples {self._pending_samples}-"
                                   f"{self._pending_samples + arrays.num_samples - 1} of shard {self.next_index} "
                                   f"(written to {self.storage.url})"))

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("ShardWriter is closed")

    def _add(self, arrays: ShardArrays) -> None:
        """Append checked samples, writing each shard as it fills: a shard ends at the first sample that
        brings it to `max_samples` or to `max_bytes` (tokens, plus 16 bytes per document segment)."""
        if self._pending and arrays.has_doc_boundaries != self._pending[0].has_doc_boundaries:
            raise ValueError(f"sample {self._pending_samples} of shard {self.next_index}: all samples of a shard must "
                             "either store document boundaries or not")
        sizes = np.diff(arrays.sample_offsets) * self._itemsize
        if arrays.has_doc_boundaries:
            sizes += np.diff(arrays.doc_offsets) * 16
        reached = np.cumsum(sizes)
        start, count = 0, arrays.num_samples
        while start < count:
            before = int(reached[start - 1]) if start else 0
            stop = count
            if self.max_bytes is not None:
                stop = min(stop, int(np.searchsorted(reached, before + self.max_bytes - self._pending_bytes)) + 1)
            if self.max_samples is not None:
                stop = min(stop, start + self.max_samples - self._pending_samples)
            self._pending.append(arrays.slice(start, stop) if (start, stop) != (0, count) else arrays)
            self._pending_samples += stop - start
            self._pending_bytes += int(reached[stop - 1]) - before
            if ((self.max_samples is not None and self._pending_samples >= self.max_samples)
                    or (self.max_bytes is not None and self._pending_bytes >= self.max_bytes)):
                self.flush()
            start = stop

    def flush(self) -> ShardInfo | None:
        """Finish the current shard now (no-op when it is empty). Returns its `ShardInfo`, or None while
        it is encoded in the background (`encode_threads`)."""
        if not self._pending:
            return None
        parts = self._pending
        self._pending = []
        self._pending_samples = 0
        self._pending_bytes = 0
        return self._write_shard(parts)

    def write_empty_shard(self) -> ShardInfo:
        """Write a shard with zero samples (valid, e.g. for an input with nothing in it)."""
        self._collect(keep=0)
        return self._write_shard([], background=False)

    def _write_shard(self, parts: list[ShardArrays], *, background: bool = True) -> ShardInfo | None:
        index = self.next_index
        self.next_index += 1
        if self.on_shard_cut is not None:
            self.on_shard_cut(index)
        if self._pool is None or not background:
            return self._done(self._store(parts, index))
        self._in_flight.append(self._pool.submit(self._store, parts, index))
        self._collect(keep=self.encode_threads)
        return None

    def _store(self, parts: list[ShardArrays], index: int) -> ShardInfo:
        """Join, encode and upload one shard's runs of samples (in any thread: it touches nothing of the
        writer's state; joining here keeps that copy of every token off the caller's thread)."""
        arrays = concat_arrays(parts, self.token_dtype)
        encoded = encode_shard(arrays, shard_format=self.shard_format, token_dtype=self.token_dtype,
                               level=self.compression_level, format_version=self.format_version, block_bytes=self.block_bytes,
                               tar_layout=self.tar_layout)
        name = self.name_template.format(index=index) + SHARD_EXTENSIONS[self.shard_format]
        self.storage.write_bytes(name, encoded.pieces)
        return ShardInfo(name=name, samples=encoded.samples, tokens=encoded.tokens,
                         compressed_bytes=encoded.size, raw_bytes=encoded.raw_bytes,
                         sha256=encoded.sha256, has_doc_boundaries=encoded.has_doc_boundaries,
                         index_offset=encoded.index_offset, index_bytes=encoded.index_bytes,
                         index_sha256=encoded.index_sha256)

    def _collect(self, *, keep: int) -> None:
        """Report the background shards that are done, in order, waiting for the oldest while more than
        `keep` are in flight (an encoding error is raised here)."""
        while self._in_flight and (len(self._in_flight) > keep or self._in_flight[0].done()):
            self._done(self._in_flight.popleft().result())

    def _done(self, info: ShardInfo) -> ShardInfo:
        self.shards.append(info)
        if self.on_shard_done is not None:
            self.on_shard_done(info)
        return info

    def close(self) -> None:
        """Write the last, partly filled shard; further writes are refused. Closing twice does nothing."""
        if not self._closed:
            try:
                self.flush()
                self._collect(keep=0)
            finally:
                self._closed = True
                self._stop_encoding()


def write_dataset(url: str | Storage, samples: Iterable[Sample | np.ndarray], *, tokenizer: TokenizerInfo,
                  seq_len: int | None, packing: str = "custom", shard_format: str = "tar",
                  token_dtype: str | None = None, sources: tuple[str, ...] = (),
                  build: dict[str, Any] | None = None, storage_options: dict[str, Any] | None = None,
                  **writer_options: Any) -> Manifest:
    """Write samples as shards, then the manifest (last, atomically). Returns the manifest."""
    from shardkit.manifest import token_dtype_for_vocab

    dtype = token_dtype or token_dtype_for_vocab(tokenizer.vocab_size)
    with ShardWriter(url, shard_format=shard_format, token_dtype=dtype, storage_options=storage_options,
                     **writer_options) as writer:
        for sample in samples:
            writer.write(sample)
    level = writer_options.get("compression_level", 3)
    manifest = Manifest(shard_format=shard_format, token_dtype=dtype, seq_len=seq_len, packing=packing,
                        tokenizer=tokenizer, shards=tuple(writer.shards), sources=tuple(sources),
                        compression={"codec": "zstd", "level": level}, build=dict(build or {}),
                        format_version=writer.manifest_version if writer.shards else None)
    write_manifest(writer.storage, manifest)
    return manifest
