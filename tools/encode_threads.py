"""How many shards a build or conversion encodes at once: one per core, as many as memory holds.

Encoding (zstd, SHA-256, the store) releases the GIL, so each thread is another core at work on the
build's last serial step (benchmarks/RESULTS.md, convert). Each shard in flight holds its samples and,
while it is encoded, about twice as much again (the compressed bytes and the encoder's buffers: 2.0x
the raw payload measured for both formats), so a thread costs about `SHARD_COPIES` shard sizes.
"""

from __future__ import annotations

import logging
import os

from shardkit.process_info import available_cores

__all__ = ["SHARD_COPIES", "available_memory", "choose_encode_threads"]

logger = logging.getLogger(__name__)
SHARD_COPIES = 3
# The rest is the tokenizer workers', the packer's and the page cache's.
MEMORY_SHARE = 0.5


def available_memory() -> int | None:
    """Bytes the system can give without swapping (MemAvailable; else free pages), None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def choose_encode_threads(shard_size: int, requested: int | None = None, *, cores: int | None = None,
                          memory: int | None = None) -> int:
    """`requested` when given (0: encode in the caller's thread); otherwise one thread per core available,
    at most as many as `MEMORY_SHARE` of the available memory holds at `SHARD_COPIES` x `shard_size`
    each, and at least one. `cores` and `memory` default to this machine's."""
    if requested is not None:
        return requested
    cores = available_cores() if cores is None else cores
    memory = available_memory() if memory is None else memory
    threads = cores
    if memory is not None:
        threads = min(threads, int(memory * MEMORY_SHARE) // (SHARD_COPIES * max(shard_size, 1)))
    threads = max(1, threads)
    logger.debug("encoding %d shards at once (%d cores, %s bytes available, %d-byte shards)", threads, cores, memory,
                 shard_size)
    return threads
