"""`ShardBlocks`: a format v2 shard's arrays, filled block by block: each block fetched, verified, decoded and placed.

The shard's arrays are allocated whole from the manifest's counts and filled as blocks arrive. A block is
claimed by one thread (the caller's, a pool's, the background completion's) before it is read, so no block is
read twice; its readers wait on its event. Each block is checked against its SHA-256 from the block index
(itself checked against the manifest), decoded, and its token ids checked: no byte is used before its hash
matched. Blocks that lie close together are read in one request (a run) and then checked one by one.

Each byte is hashed once. The blocks and the index are every byte a reader of the arrays uses, and each is
checked against its SHA-256 on the way in, so the whole file's SHA-256 is computed only when the shard's
bytes themselves are kept (`keep_bytes`, the "compressed" cache), which also serves the bytes outside every
block (format headers and footers that only a standalone reader of the file needs). Checking the whole file
as well would hash every byte twice: it was a fifth of a cold pass.

A corrupt block gets one re-read, then `CorruptShardError` naming the shard and the block; the failure is kept
and raised to every later reader of the shard.

When each block is read (for a batch, in the background) is decided by the two layers above:
`block_completion.py` (the rest of the shard, in the background) and `block_reader.py` (what a batch asks for).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable

import numpy as np

from shardkit.errors import CorruptShardError
from shardkit.formats import ShardReader
from shardkit.formats.blocks import BlockIndex
from shardkit.formats.fetch import read_block, read_block_index
from shardkit.formats.sample import DOC_INDEX_DTYPE, DOC_SOURCE_DTYPE, DOC_STARTS_DTYPE, OFFSETS_DTYPE, ShardArrays
from shardkit.formats.shard_bytes import decode_block
from shardkit.manifest import Manifest, ShardInfo
from shardkit.storage import Storage

# A block's state: no thread reads it yet, one thread claimed it (its readers wait on its event), placed.
_MISSING, _CLAIMED, _DONE = 0, 1, 2


class ShardBlocks:
    """A v2 shard's arrays and the state of each of its blocks; loads (reads, verifies, decodes, places) blocks.

    Args:
        storage_of: returns the dataset's `Storage` (the cache re-creates it after a fork).
        shard: the manifest entry (must have a block index and samples).
        manifest: the dataset's manifest (format, token dtype, sample length, vocabulary).
        on_read: called with the byte count of every read (download statistics).
        keep_bytes: assemble the shard's file too (for a cache that stores the file).
        held_index: the shard's block index already at hand (the dataset's `shardkit.blocks`): used instead
            of a ranged read once it passes the checks a read index passes (`read_block_index`).
    """

    def __init__(self, storage_of: Callable[[], Storage], shard: ShardInfo, manifest: Manifest, *,
                 on_read: Callable[[int], None] | None = None, keep_bytes: bool = False,
                 held_index: bytes | None = None):
        if not shard.has_block_index or not shard.samples:
            raise ValueError(f"shard {shard.name} has no block index (format v1 or empty): read it whole")
        self._storage_of = storage_of
        self.shard = shard
        self.manifest = manifest
        self._on_read = on_read
        self._lock = threading.Lock()
        self._index: BlockIndex | None = None
        self._held_index = held_index
        self._state: list[int] = []
        self._events: list[threading.Event] = []
        self._failure: BaseException | None = None
        # The file being assembled, when kept. Uninitialised (pages are touched only as bytes arrive):
        # zeroing a 64 MiB buffer cost more than the first batch's blocks.
        self._buffer = np.empty(shard.compressed_bytes if keep_bytes else 0, dtype=np.uint8)
        self._keep_bytes = keep_bytes
        self.complete = False
        self.arrays = self._allocate()
        length = manifest.sample_length
        self.reader = ShardReader(self.arrays, name=shard.name, fixed_length=length if self._fixed_offsets else None)
        # Blocks a first batch read, verified and decoded without placing them (`request_samples`), with their bytes when
        # kept: whoever loads such a block later places these instead of reading and decoding it again.
        self._decoded: dict[int, tuple[ShardArrays, bytes | memoryview | None]] = {}

    def _allocate(self) -> ShardArrays:
        shard, length = self.shard, self.manifest.sample_length
        tokens = np.empty(shard.tokens, dtype=self.manifest.token_dtype)
        # Fixed-length data: every offset is known now, and each block's decoded offsets must agree.
        fixed = length is not None and shard.tokens == shard.samples * length
        offsets = (np.arange(shard.samples + 1, dtype=OFFSETS_DTYPE) * length if fixed
                   else np.zeros(shard.samples + 1, dtype=OFFSETS_DTYPE))
        self._fixed_offsets = fixed
        if not shard.has_doc_boundaries:
            return ShardArrays(tokens, offsets)
        # Segment arrays are sized when the index arrives (their count is in it, not in the manifest).
        return ShardArrays(tokens, offsets, np.zeros(shard.samples + 1, dtype=OFFSETS_DTYPE),
                           np.zeros(0, DOC_STARTS_DTYPE), np.zeros(0, DOC_SOURCE_DTYPE), np.zeros(0, DOC_INDEX_DTYPE))

    @property
    def url(self) -> str:
        return self._storage_of().url_of(self.shard.name)

    # -- the index ------------------------------------------------------------------------------
    def _load_index(self) -> BlockIndex:
        with self._lock:
            if self._index is not None:
                return self._index
            index = read_block_index(self._storage_of(), self.shard, on_read=self._on_read, held=self._held_index)
            if self._keep_bytes:  # part of the file: keep them rather than read them again
                self._buffer[self.shard.index_offset:self.shard.index_offset + self.shard.index_bytes] = \
                    np.frombuffer(index.to_bytes(), dtype=np.uint8)
            if self.shard.has_doc_boundaries:
                count = index.doc_count
                arrays = self.arrays
                self.arrays = ShardArrays(arrays.tokens, arrays.sample_offsets, arrays.doc_offsets,
                                          np.empty(count, DOC_STARTS_DTYPE), np.empty(count, DOC_SOURCE_DTYPE),
                                          np.empty(count, DOC_INDEX_DTYPE))
                self.reader.arrays = self.arrays
            self._state = [_MISSING] * len(index.blocks)
            self._events = [threading.Event() for _ in index.blocks]
            self._index = index
            return index

    def _load_runs(self, runs: deque[tuple[int, int]]) -> None:
        """Load runs taken one at a time from `runs` (shared with other threads) until none is left."""
        while True:
            try:
                run = runs.popleft()
            except IndexError:
                return
            self._load_run(run)

    def _claim_needed(self, needed: Iterable[int], *, gap_bytes: int | None) -> list[tuple[int, int]]:
        """Claim the missing blocks among `needed` as runs (first, last) to read one request each: needed
        blocks merge across missing blocks when the bytes between them are at most `gap_bytes` (None: a run
        per block)."""
        blocks = self._index.blocks
        runs: list[tuple[int, int]] = []
        with self._lock:
            for k in sorted(k for k in set(needed) if self._state[k] == _MISSING):
                # A block a first batch decoded is a run of its own: placed without reading its bytes again.
                if runs and gap_bytes is not None and k not in self._decoded and runs[-1][1] not in self._decoded:
                    first, last = runs[-1]
                    between = range(last + 1, k)
                    if (blocks[k].byte_start - blocks[last].byte_end <= gap_bytes
                            and all(self._state[j] == _MISSING and j not in self._decoded for j in between)):
                        for j in between:
                            self._state[j] = _CLAIMED
                        self._state[k] = _CLAIMED
                        runs[-1] = (first, k)
                        continue
                self._state[k] = _CLAIMED
                runs.append((k, k))
        return runs

    def _unclaim(self, runs: list[tuple[int, int]]) -> None:
        with self._lock:
            for first, last in runs:
                for k in range(first, last + 1):
                    self._state[k] = _MISSING

    def _load_run(self, run: tuple[int, int], scratch: bytearray | None = None) -> None:
        """Read blocks `first..last` in one request and load each (each checked on its own; a block that
        fails is read again alone). With `scratch` (the completion's buffer, at least the run's size) a
        local file is read into it; blocks are decoded from views of the bytes read, never copies (slicing
        bytes copied a whole shard), and each is copied into place before this returns."""
        first, last = run
        if first == last and (scratch is None or first in self._decoded):
            self._load_block(first)
            return
        blocks = self._index.blocks
        start, end = blocks[first].byte_start, blocks[last].byte_end
        try:
            storage = self._storage_of()
            data = (storage.read_range_into(self.shard.name, start, end, scratch) if scratch is not None
                    else memoryview(storage.read_range(self.shard.name, start, end)))
            if self._on_read is not None:
                self._on_read(len(data))
            for k in range(first, last + 1):
                b = blocks[k]
                self._load_block(k, data=data[b.byte_start - start:b.byte_end - start])
        except BaseException as err:
            self._failure = self._failure or err
            for k in range(first, last + 1):  # wake the readers of the run's other blocks: they raise it
                self._events[k].set()
            raise

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _load_block(self, number: int, data: bytes | memoryview | None = None) -> None:
        """Read (or check `data`), verify, decode and place block `number`; on failure record it and raise."""
        block = self._index.blocks[number]
        try:
            decoded = self._decoded.pop(number, None)
            arrays, raw = decoded if decoded is not None else self._read_decoded(number, data)
            self._place(block, arrays)
            if self._keep_bytes:
                self._buffer[block.byte_start:block.byte_end] = np.frombuffer(raw, dtype=np.uint8)
            with self._lock:
                self._state[number] = _DONE
        except BaseException as err:
            self._failure = self._failure or err
            raise
        finally:
            self._events[number].set()

    def _read_decoded(self, number: int, data: bytes | memoryview | None = None) -> tuple[ShardArrays, bytes]:
        """Block `number` read (or `data` checked), verified, decoded and its arrays checked: (arrays, its bytes)."""
        block = self._index.blocks[number]
        raw = read_block(self._storage_of(), self.shard, block, number, on_read=self._on_read, data=data)
        url = self.url
        arrays = decode_block(raw, block, number=number, shard_format=self.manifest.shard_format,
                              token_dtype=self.manifest.token_dtype, has_docs=self.shard.has_doc_boundaries, shard=url)
        self._check(block, arrays, number, url)
        return arrays, raw

    def _check(self, block, arrays: ShardArrays, number: int, url: str) -> None:
        """A decoded block's token ids are in the vocabulary and, for fixed-length data, its samples have the
        manifest's length."""
        vocab = self.manifest.tokenizer.vocab_size
        if arrays.tokens.size and int(arrays.tokens.max()) >= vocab:
            position = int(np.argmax(arrays.tokens >= vocab))
            sample = block.sample_start + int(np.searchsorted(arrays.sample_offsets, position, side="right")) - 1
            raise CorruptShardError(url, f"{block.describe(number)}: sample {sample} holds token id "
                                         f"{int(arrays.tokens[position])}, outside the tokenizer's vocabulary of "
                                         f"{vocab} ids")
        if self._fixed_offsets and not np.array_equal(self.arrays.sample_offsets[block.sample_start:block.sample_end + 1],
                                                      block.token_start + arrays.sample_offsets):
            raise CorruptShardError(url, f"{block.describe(number)} holds samples of another length than the "
                                         f"manifest's {self.manifest.sample_length} tokens")

    def _place(self, block, arrays: ShardArrays) -> None:
        """Copy a checked block into the shard's arrays."""
        target = self.arrays
        offsets = block.token_start + arrays.sample_offsets
        s0, s1 = block.sample_start, block.sample_end
        target.tokens[block.token_start:block.token_end] = arrays.tokens
        target.sample_offsets[s0:s1 + 1] = offsets
        if target.doc_offsets is not None:
            target.doc_offsets[s0:s1 + 1] = block.doc_start + arrays.doc_offsets
            for name in ("doc_starts", "doc_source", "doc_index"):
                getattr(target, name)[block.doc_start:block.doc_end] = getattr(arrays, name)
