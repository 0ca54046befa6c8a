"""Helpers shared by the loader tests: small real datasets written with ShardWriter."""

from __future__ import annotations

import fcntl
import os

import numpy as np

from shardkit.formats import Sample, write_dataset
from shardkit.manifest import Manifest, TokenizerInfo

VOCAB = 60000


def fixed_sample(i: int, length: int, *, docs: bool = True) -> Sample:
    """A sample whose tokens encode its global id, so tests can check what they received."""
    tokens = (np.arange(length, dtype=np.int64) * 7 + i) % VOCAB
    tokens[0] = i % VOCAB
    tokens[1] = (i // VOCAB) % VOCAB
    if not docs:
        return Sample(tokens)
    starts = np.array([0, 1 + i % (length - 2)]) if length > 2 else np.array([0])
    return Sample(tokens, starts, np.zeros(len(starts), dtype=np.int64), np.arange(len(starts)) + 2 * i)


def write_fixed(url: str, num_samples: int, *, seq_len: int = 16, per_shard: int = 64, docs: bool = True,
                shard_format: str = "tar", storage_options: dict | None = None, offset: int = 0) -> Manifest:
    samples = (fixed_sample(offset + i, seq_len + 1, docs=docs) for i in range(num_samples))
    return write_dataset(url, samples, tokenizer=TokenizerInfo(kind="byte", name="test", vocab_size=VOCAB),
                         seq_len=seq_len, packing="concat", shard_format=shard_format, max_samples=per_shard,
                         storage_options=storage_options)


def write_variable(url: str, num_samples: int, *, max_len: int = 64, per_shard: int = 50, seed: int = 0) -> Manifest:
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(num_samples):
        n = int(rng.integers(2, max_len + 1))
        tokens = np.full(n, i % VOCAB, dtype=np.int64)
        samples.append(Sample(tokens, np.array([0]), np.zeros(1, dtype=np.int64), np.array([i])))
    return write_dataset(url, samples, tokenizer=TokenizerInfo(kind="byte", name="test", vocab_size=VOCAB, pad_id=0),
                         seq_len=None, packing="none", max_samples=per_shard)


def ids_from_tokens(tokens) -> np.ndarray:
    """Recover the global sample id that `fixed_sample` encoded in the first two tokens."""
    t = np.asarray(tokens, dtype=np.int64)
    return t[:, 0] + VOCAB * t[:, 1]


def lock_is_held(path: str) -> bool:
    """Whether another process holds an flock on `path` (a missing file is not held)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
