"""`BlockCompletion`: the rest of a shard read block by block, fetched in the background and handed on whole.

A background thread fetches the blocks no batch has read in large coalesced ranges and hands the complete arrays
to `on_complete` (the cache writes its file there, or nothing). It starts at the second `ensure` of the reader
(`block_reader.py`), so the first batch's blocks have the link (and the CPU) to themselves, and from then on
serves the blocks readers wait for first. An error in the background is raised by the next `ensure`, so a
corrupt shard is reported even when the samples a rank needs happened to be intact.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np

from shardkit.errors import CorruptShardError
from shardkit.formats import check_shard_bytes, read_shard
from shardkit.formats.blocks import BlockIndex
from shardkit.formats.sample import ShardArrays
from shardkit.manifest import Manifest, ShardInfo
from shardkit.storage import Storage

from .shard_blocks import _CLAIMED, _MISSING, ShardBlocks

logger = logging.getLogger(__name__)

# The background completion reads up to this many bytes per request: a 64 MiB shard in a few requests
# (each costs a round trip, a request fee, and on moto a read of the whole object), bounded memory.
COMPLETION_RANGE_BYTES = 32 << 20


class BlockCompletion(ShardBlocks):
    """`ShardBlocks` that can complete themselves in a background thread.

    Args (beside `ShardBlocks`'):
        on_complete: called once with (arrays, the shard's bytes or None) when the shard is complete and
            verified (by the background completion, `complete_in_background`; without it, blocks are read on
            demand only).
        keep_bytes: assemble the shard's file too and check its whole SHA-256 (for a cache that stores the
            file); its bytes then reach `on_complete`, else None.
    """

    def __init__(self, storage_of: Callable[[], Storage], shard: ShardInfo, manifest: Manifest, *,
                 on_read: Callable[[int], None] | None = None,
                 on_complete: Callable[[ShardArrays, bytes | memoryview | None], None] | None = None,
                 keep_bytes: bool = False, held_index: bytes | None = None):
        super().__init__(storage_of, shard, manifest, on_read=on_read, keep_bytes=keep_bytes, held_index=held_index)
        self._on_complete = on_complete
        self._completion: threading.Thread | None = None
        self._on_failure: Callable[[], None] | None = None
        self._wants_completion = False
        self._cancelled = False
        self._wanted: set[int] = set()  # blocks readers wait for: the completion reads them first

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
