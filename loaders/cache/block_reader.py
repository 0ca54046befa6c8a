"""`BlockReader`: a format v2 shard read block by block, before it is local (not `partial_batches`, which is
what an epoch does with its last, smaller batch).

The shard's arrays are allocated whole from the manifest's counts and filled as blocks arrive. Before a
batch is gathered, `ensure(samples)` fetches the blocks holding those samples with ranged reads (in
parallel; from remote storage neighbouring blocks in one read), checks each against its SHA-256 from the
block index (itself checked against the manifest), decodes it and checks its token ids: no byte is used
before its hash matched. A batch that spans several cold shards reads them all at once: `start_index` on
each, then `request` on each, then `wait` on each (`ensure` is the three for one shard). An iteration's first
batch takes its samples from their decoded blocks instead (`request_samples`), leaving the blocks to be placed
later, without a second read or decode: placing them is what a first batch paid most for. A background thread
fetches the rest in large coalesced ranges and hands the complete arrays to `on_complete` (the cache
writes its file there, or nothing). It starts at the second `ensure`, so the first batch's blocks have the
link (and the CPU) to themselves, and from then on serves the blocks readers wait for first.

Each byte is hashed once. The blocks and the index are every byte a reader of the arrays uses, and each is
checked against its SHA-256 on the way in, so the whole file's SHA-256 is computed only when the shard's
bytes themselves are kept (`keep_bytes`, the "compressed" cache), which also serves the bytes outside every
block (format headers and footers that only a standalone reader of the file needs). Checking the whole file
as well would hash every byte twice: it was a fifth of a cold pass.

A corrupt block gets one re-read, then `CorruptShardError` naming the shard and the block; an error in
the background is raised by the next `ensure`, so a corrupt shard is reported even when the samples a
rank needs happened to be intact.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import numpy as np

from shardkit.errors import CorruptShardError
from shardkit.formats import ShardReader, check_shard_bytes, read_shard
from shardkit.formats.blocks import BlockIndex
from shardkit.formats.fetch import read_block, read_block_index
from shardkit.formats.sample import DOC_INDEX_DTYPE, DOC_SOURCE_DTYPE, DOC_STARTS_DTYPE, OFFSETS_DTYPE, ShardArrays
from shardkit.formats.shard_bytes import decode_block
from shardkit.manifest import Manifest, ShardInfo
from shardkit.process_info import available_cores, loader_worker_info
from shardkit.storage import Storage

logger = logging.getLogger(__name__)

# The background completion reads up to this many bytes per request: a 64 MiB shard in a few requests
# (each costs a round trip, a request fee, and on moto a read of the whole object), bounded memory.
COMPLETION_RANGE_BYTES = 32 << 20
# Blocks a batch needs are read in one request when the bytes between them (other blocks, verified and
# kept too) are at most this many: on S3 a request costs ~20-50 ms before its first byte, 256 KiB a few
# ms at one connection's ~50-100 MB/s, so the merge saves a request and costs no time; a wider gap would
# make the batch wait for bytes it does not need (the requests run in parallel anyway).
COALESCE_GAP_BYTES = 256 << 10
# A request's local blocks (a shuffled first batch needs a block per sample) are decoded by the block pool beside
# the caller's thread when they average at least this many raw bytes: most of such a block's decode lets go of
# the GIL (an Arrow record batch of 1 MiB: ~1.5 ms, mostly zstd), while a smaller block's is mostly Python that
# holds it (tar's members of 256 KiB groups: a second thread only contended for the GIL, and made the first
# batch slower on a loaded machine).
PARALLEL_DECODE_BLOCK_BYTES = 512 << 10
_MISSING, _CLAIMED, _DONE = 0, 1, 2


@dataclass
class BlockRequest:
    """Reads started by `BlockReader.request`; `wait()` returns once their blocks are verified and placed."""

    shard: BlockReader | None = None
    needed: list[int] = field(default_factory=list)
    # Read by `wait` in the caller's thread, and by the helpers among `futures` beside it (each takes the next).
    local_runs: deque[tuple[int, int]] = field(default_factory=deque)
    futures: list[Future] = field(default_factory=list)

    def wait(self) -> None:
        """Raises:
            CorruptShardError: a block failed its check twice, or the background completion failed.
        """
        if self.shard is not None:
            self.shard._wait(self)


def _decode_helpers() -> int:
    """Threads beside the caller's that decode a request's local blocks: one per other core of this process's
    share (a DataLoader worker shares the cores with the other workers, which read their own batches)."""
    info = loader_worker_info()
    return max(available_cores() // (info.num_workers if info is not None else 1) - 1, 0)


class BlockReader:
    """A v2 shard whose blocks are fetched, verified and decoded on demand, and completed in the background.

    Args:
        storage_of: returns the dataset's `Storage` (the cache re-creates it after a fork).
        shard: the manifest entry (must have a block index and samples).
        manifest: the dataset's manifest (format, token dtype, sample length, vocabulary).
        executor: runs the block reads of one `ensure` in parallel.
        on_read: called with the byte count of every read (download statistics).
        on_complete: called once with (arrays, the shard's bytes or None) when the shard is complete and
            verified (by the background completion, `complete_in_background`; without it, blocks are read on
            demand only).
        keep_bytes: assemble the shard's file too and check its whole SHA-256 (for a cache that stores the
            file); its bytes then reach `on_complete`, else None.
    """

    def __init__(self, storage_of: Callable[[], Storage], shard: ShardInfo, manifest: Manifest, *,
                 executor: Executor, on_read: Callable[[int], None] | None = None,
                 on_complete: Callable[[ShardArrays, bytes | memoryview | None], None] | None = None,
                 keep_bytes: bool = False):
        if not shard.has_block_index or not shard.samples:
            raise ValueError(f"shard {shard.name} has no block index (format v1 or empty): read it whole")
        self._storage_of = storage_of
        self.shard = shard
        self.manifest = manifest
        self._executor = executor
        self._on_read = on_read
        self._on_complete = on_complete
        self._lock = threading.Lock()
        self._index: BlockIndex | None = None
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
        self._completion: threading.Thread | None = None
        self._on_failure: Callable[[], None] | None = None
        self._wants_completion = False
        self._cancelled = False
        self._ensured = 0
        self._index_future: Future | None = None
        self._wanted: set[int] = set()  # blocks readers wait for: the completion reads them first
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
            index = read_block_index(self._storage_of(), self.shard, on_read=self._on_read)
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

    # -- foreground -----------------------------------------------------------------------------
    def start_index(self) -> None:
        """Start reading the block index in the background (remote shards), so that the indexes of the
        shards one batch needs arrive together; `request` waits for it."""
        if self._index is None and self._index_future is None and not self._storage_of().is_local:
            self._index_future = self._executor.submit(self._load_index)

    def ensure(self, local_samples: Iterable[int] | np.ndarray) -> None:
        """Return once the given samples (indices within the shard) are verified and decoded.

        Raises:
            CorruptShardError: a block failed its check twice, or the background completion failed.
        """
        self.request(local_samples).wait()

    def request(self, local_samples: Iterable[int] | np.ndarray) -> BlockRequest:
        """Start reading the blocks holding the given samples; the result's `wait()` returns once they are
        verified and decoded. Remote reads start now, in parallel; local ones run in `wait()` (and in the pool
        beside it, for large blocks)."""
        self._raise_failure()
        if self.complete:
            return BlockRequest()
        index = self._ready_index()
        needed = index.blocks_of(np.asarray(local_samples, dtype=np.int64).reshape(-1))
        # The first batch reads its own blocks. Later ones leave them to the background completion, which
        # reads the blocks they wait for first, in runs of up to 32 MiB: a block per request would cost
        # hundreds of requests per shard (and throttling from object stores) for bytes it fetches anyway.
        delegate = self._wants_completion and self._ensured > 0
        self._ensured += 1
        if delegate:
            with self._lock:
                self._wanted.update(k for k in needed if self._state[k] == _MISSING)
            self.start_completion()
            return BlockRequest(self, list(needed))
        if not self._storage_of().is_local:
            # Remote reads wait on the network: in parallel, neighbouring blocks in one request.
            runs = self._claim_needed(needed, gap_bytes=COALESCE_GAP_BYTES)
            return BlockRequest(self, list(needed), futures=[self._executor.submit(self._load_run, r) for r in runs])
        # Local reads are page-cache copies: no request to save, so a block each (never one the batch does not
        # need), decoded in `wait` by the caller's thread and, for enough bytes, by helpers beside it.
        runs = deque(self._claim_needed(needed, gap_bytes=None))
        helpers = self._helpers([first for first, _ in runs])
        return BlockRequest(self, list(needed), local_runs=runs,
                            futures=[self._executor.submit(self._load_runs, runs) for _ in range(helpers)])

    def _ready_index(self) -> BlockIndex:
        """The block index, once read (by `start_index`'s background read, or now in this thread)."""
        if self._index_future is not None:
            try:
                self._index_future.result()
            except BaseException as err:  # noqa: BLE001 - read again below, in this thread, where it raises
                logger.debug("background read of the block index of %s failed: %s", self.shard.name, err)
            self._index_future = None
        return self._load_index()

    def request_samples(self, local_samples: Iterable[int] | np.ndarray) -> Callable[[], list[ShardArrays]]:
        """Start reading the given samples for a first batch; the function returned waits for them and gives each
        as arrays of its own. Their blocks are read, verified, decoded and checked as `request` does, but not
        copied into the shard's arrays: placing a 1 MiB block there first touches fresh pages of a whole-shard
        array (2 MiB pages that numpy asks for, each zeroed whole, compacted for under memory pressure), which
        cost as much as the decode. The blocks are kept and placed by whoever loads them next (the completion,
        a later batch), never read or decoded again. Counts as this reader's first `ensure`: the next one hands
        its blocks to the completion. Remote reads start now, in parallel; local ones run in the function (and
        in the pool beside it, for large blocks).

        Raises (from the function):
            CorruptShardError: a block failed its check twice, or the background completion failed.
        """
        self._raise_failure()
        local = np.asarray(local_samples, dtype=np.int64).reshape(-1)
        index = self._ready_index()  # a complete shard's blocks are all placed: its samples come from its arrays
        self._ensured += 1
        block_of = np.searchsorted(index.sample_ends, local, side="right").tolist()
        with self._lock:  # placed blocks are read from the shard's arrays; the others are decoded for this batch
            todo = deque(sorted(k for k in set(block_of) if self._state[k] != _DONE and k not in self._decoded))
        decoded: dict[int, tuple[ShardArrays, bytes | memoryview | None]] = {}

        def decode_next() -> None:
            while True:
                try:
                    k = todo.popleft()
                except IndexError:
                    return
                try:
                    arrays, raw = self._read_decoded(k)
                except BaseException as err:
                    self._failure = self._failure or err  # the shard is refused for every later read too
                    raise
                decoded[k] = (arrays, raw if self._keep_bytes else None)

        remote = not self._storage_of().is_local
        helpers = len(todo) if remote else self._helpers(list(todo))
        futures = [self._executor.submit(decode_next) for _ in range(helpers)]

        def wait() -> list[ShardArrays]:
            try:
                decode_next()
            finally:
                for future in futures:
                    future.result()
            for k, item in decoded.items():  # kept for the load that places them (never a second copy)
                self._decoded.setdefault(k, item)
            out = []
            for i, k in zip(local.tolist(), block_of):
                held = decoded.get(k) or self._decoded.get(k)
                if held is None:  # placed: by an earlier load, or by one that took the kept arrays meanwhile
                    self._events[k].wait()
                    self._raise_failure()
                    out.append(self.arrays.slice(i, i + 1))
                else:
                    first = index.blocks[k].sample_start
                    out.append(held[0].slice(i - first, i - first + 1))
            return out

        return wait

    def _helpers(self, blocks: list[int]) -> int:
        """Threads beside the caller's that decode these local blocks: none for small blocks (mostly Python under
        the GIL), else one per other core of this process's share, at most one per block but the caller's."""
        raw_bytes = sum(self._index.blocks[k].raw_bytes for k in blocks)
        if len(blocks) < 2 or raw_bytes < PARALLEL_DECODE_BLOCK_BYTES * len(blocks):
            return 0
        return min(len(blocks) - 1, _decode_helpers())

    def _load_runs(self, runs: deque[tuple[int, int]]) -> None:
        """Load runs taken one at a time from `runs` (shared with other threads) until none is left."""
        while True:
            try:
                run = runs.popleft()
            except IndexError:
                return
            self._load_run(run)

    def _wait(self, request: BlockRequest) -> None:
        errors: list[BaseException] = []
        try:
            self._load_runs(request.local_runs)
        except BaseException as err:  # noqa: BLE001 - re-raised below, after the others finished
            errors.append(err)
            left = []
            with contextlib.suppress(IndexError):  # the helpers may be taking the last runs too
                while True:
                    left.append(request.local_runs.popleft())
            self._unclaim(left)  # nobody may wait for blocks no one reads
        for future in request.futures:
            try:
                future.result()
            except BaseException as err:  # noqa: BLE001
                errors.append(err)
        if errors:
            raise errors[0]
        for k in request.needed:  # blocks another thread (the background completion) claimed first
            self._events[k].wait()
        self._raise_failure()

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

    # -- background -----------------------------------------------------------------------------
    def complete_in_background(self, on_failure: Callable[[], None] | None = None) -> None:
        """From the second `ensure` on (so that the first batch does not share the link with it), fetch
        every block not yet fetched in a daemon thread, those readers wait for first, then verify the whole
        shard (`on_failure` runs in that thread if it fails)."""
        self._on_failure = on_failure
        self._wants_completion = True

    def start_completion(self) -> None:
        """Start the background completion now, if this reader is to complete the shard and it has not
        started (the second `ensure` does; a reader that stops before it must not leave the shard, and its
        node's download lock, unfinished)."""
        with self._lock:
            if not self._wants_completion or self._completion is not None:
                return
            # Started under the lock: a `wait_complete` in another thread must never see a thread not yet
            # started (join() raises on one).
            self._completion = threading.Thread(target=self._complete, name=f"shardkit-complete-{self.shard.name}",
                                                daemon=True)
            self._completion.start()

    def cancel(self) -> None:
        """Stop the background completion after its current read (nothing is stored, nothing raised)."""
        self._cancelled = True

    def wait_complete(self, timeout: float | None = None) -> bool:
        if self._completion is not None:
            self._completion.join(timeout)
        return self.complete

    def _complete(self) -> None:
        try:
            index = self._load_index()
            scratch = bytearray(0)  # one buffer for every run's bytes, grown when a run needs more
            while not self._cancelled and (run := self._claim_run()) is not None:
                size = index.blocks[run[1]].byte_end - index.blocks[run[0]].byte_start
                if len(scratch) < size:
                    scratch = bytearray(size)
                self._load_run(run, scratch)
            if self._cancelled:
                if self._on_failure is not None:
                    self._on_failure()
                return
            for event in self._events:
                event.wait()
            self._raise_failure()
            data = None
            if self._keep_bytes:
                self._read_gaps(index)
                data = self._verified_whole()
            # No `check_decoded` pass over the whole shard: the index tiles the manifest's counts, each
            # block's decoded counts matched its entry, and `_check` checked its token ids.
            self._decoded.clear()  # blocks a first batch decoded while another load placed them too
            self.complete = True
            self._buffer = np.empty(0, dtype=np.uint8)
            if self._on_complete is not None:
                self._on_complete(self.arrays, data)
        except BaseException as err:  # noqa: BLE001 - raised in the foreground by the next ensure()
            self._failure = self._failure or err
            for event in self._events:  # wake readers waiting on blocks this thread had claimed
                event.set()
            logger.warning("background completion of shard %s failed: %s", self.shard.name, err)
            if self._on_failure is not None:
                self._on_failure()

    def _claim_run(self) -> tuple[int, int] | None:
        """Claim the next run of consecutive missing blocks (up to `COMPLETION_RANGE_BYTES`)."""
        blocks = self._index.blocks
        with self._lock:
            wanted = sorted(k for k in self._wanted if self._state[k] == _MISSING)
            self._wanted.clear()
            first = wanted[0] if wanted else next((k for k, s in enumerate(self._state) if s == _MISSING), None)
            if first is None:
                return None
            self._wanted.update(wanted[1:])
            last = first
            self._state[first] = _CLAIMED
            # A block a first batch decoded is placed on its own, without reading its bytes again.
            while (first not in self._decoded and last + 1 < len(blocks) and self._state[last + 1] == _MISSING
                   and last + 1 not in self._decoded
                   and blocks[last + 1].byte_end - blocks[first].byte_start <= COMPLETION_RANGE_BYTES):
                last += 1
                self._state[last] = _CLAIMED
            return first, last

    def _read_gaps(self, index: BlockIndex) -> None:
        """The bytes outside every block (format headers, the index, footers): checked by the whole hash."""
        known = sorted([(b.byte_start, b.byte_end) for b in index.blocks]
                       + [(self.shard.index_offset, self.shard.index_offset + self.shard.index_bytes)])
        cursor = 0
        storage = self._storage_of()
        for start, end in [*known, (self.shard.compressed_bytes, self.shard.compressed_bytes)]:
            if start > cursor:
                data = storage.read_range(self.shard.name, cursor, start)
                if self._on_read is not None:
                    self._on_read(len(data))
                self._buffer[cursor:cursor + len(data)] = np.frombuffer(data, dtype=np.uint8)
            cursor = max(cursor, end)

    def _verified_whole(self) -> bytes | memoryview:
        """The whole shard, checked against the manifest's SHA-256 like any shard; a mismatch here can
        only lie outside the blocks (each block was checked), so the shard is read whole once more.
        A view of the assembled buffer, not a copy: a copy of a 64 MiB shard was a tenth of the completion."""
        data = memoryview(self._buffer)
        try:
            check_shard_bytes(data, shard=self.url, sha256=self.shard.sha256, size=self.shard.compressed_bytes)
            return data
        except CorruptShardError as err:
            logger.warning("shard %s assembled from its blocks failed its check (%s): reading it whole", self.url,
                           err.reason)
            return read_shard(self._storage_of(), self.shard, on_read=self._on_read)
