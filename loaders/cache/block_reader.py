"""`BlockReader`: a format v2 shard read block by block, before it is local (not `partial_batches`, which is
what an epoch does with its last, smaller batch).

Before a batch is gathered, `ensure(samples)` fetches the blocks holding those samples with ranged reads (in
parallel; from remote storage neighbouring blocks in one read), and loads them as `shard_blocks.py` does: each
verified against its SHA-256, decoded and checked before any byte is used. A batch that spans several cold
shards reads them all at once: `start_index` on each, then `request` on each, then `wait` on each (`ensure` is
the three for one shard). An iteration's first batch takes its samples from their decoded blocks instead
(`request_samples`), leaving the blocks to be placed later, without a second read or decode: placing them is
what a first batch paid most for. From the second `ensure` on, the blocks a batch needs are left to the
background completion (`block_completion.py`), which reads them first.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import numpy as np

from shardkit.formats.blocks import BlockIndex
from shardkit.formats.sample import ShardArrays
from shardkit.manifest import Manifest, ShardInfo
from shardkit.process_info import available_cores, loader_worker_info
from shardkit.storage import Storage

from .block_completion import BlockCompletion
from .shard_blocks import _DONE, _MISSING

logger = logging.getLogger(__name__)

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

class BlockReader(BlockCompletion):
    """A v2 shard whose blocks are fetched, verified and decoded on demand, and completed in the background.

    Args:
        executor: runs the block reads of one `ensure` in parallel.
        storage_of, shard, manifest, on_read, on_complete, keep_bytes, held_index: as `BlockCompletion`'s and
            `ShardBlocks`' (the shard must have a block index and samples).
    """

    def __init__(self, storage_of: Callable[[], Storage], shard: ShardInfo, manifest: Manifest, *,
                 executor: Executor, on_read: Callable[[int], None] | None = None,
                 on_complete: Callable[[ShardArrays, bytes | memoryview | None], None] | None = None,
                 keep_bytes: bool = False, held_index: bytes | None = None):
        super().__init__(storage_of, shard, manifest, on_read=on_read, on_complete=on_complete, keep_bytes=keep_bytes,
                         held_index=held_index)
        self._executor = executor
        self._ensured = 0
        self._index_future: Future | None = None

    # -- foreground -----------------------------------------------------------------------------
    def start_index(self) -> None:
        """Start reading the block index in the background (remote shards), so that the indexes of the
        shards one batch needs arrive together; `request` waits for it. An index at hand (`held_index`) is
        parsed by `request` itself: no read to overlap."""
        if (self._index is None and self._index_future is None and self._held_index is None
                and not self._storage_of().is_local):
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
