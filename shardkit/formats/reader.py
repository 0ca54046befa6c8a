"""`ShardReader`: random access to the samples of one shard.

A reader wraps `ShardArrays`. Opened on a decoded cache file (`ShardReader.open_decoded`) every
array is a zero-copy view over one mmap, so `tokens(i)` and `gather(indices)` do no per-sample
decoding: a batch of fixed-length samples is one numpy fancy-index over a [samples, length] view.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shardkit.errors import CorruptShardError
from shardkit.formats.shard_bytes import check_shard_bytes, decode_shard
from shardkit.formats.decoded import open_decoded
from shardkit.formats.sample import Sample, ShardArrays
from shardkit.manifest import Manifest, ShardInfo


class ShardReader:
    """Random access to one shard's samples.

    Args:
        arrays: the shard's flat arrays.
        name: the shard's name, used in error messages.
        fixed_length: tokens per sample when known beforehand (a shard still being filled block by block,
            whose offsets are not all known yet); otherwise derived from the offsets.
    """

    def __init__(self, arrays: ShardArrays, *, name: str, fixed_length: int | None = None):
        self.arrays = arrays
        self.name = name
        if fixed_length is None and arrays.sample_offsets[-1] == arrays.tokens.size:
            lengths = np.diff(arrays.sample_offsets)
            fixed_length = int(lengths[0]) if len(lengths) and np.all(lengths == lengths[0]) else None
        self.fixed_length: int | None = fixed_length or None
        self._tokens_2d = (arrays.tokens.reshape(-1, self.fixed_length)
                           if self.fixed_length else None)

    @classmethod
    def open_decoded(cls, path: str, *, name: str | None = None) -> ShardReader:
        """Open a decoded cache file through mmap (zero-copy)."""
        return cls(open_decoded(path, shard=name), name=name or path)

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, *, shard: ShardInfo, manifest: Manifest,
                   verify: bool = True) -> ShardReader:
        """Decode a shard file held in memory; checks size and SHA-256 first when `verify`."""
        if verify:
            check_shard_bytes(data, shard=shard.name, sha256=shard.sha256, size=shard.compressed_bytes)
        arrays = decode_shard(data, shard_format=manifest.shard_format, token_dtype=manifest.token_dtype,
                              shard=shard.name, raw_bytes=shard.raw_bytes)
        check_decoded(arrays, shard, vocab_size=manifest.tokenizer.vocab_size)
        return cls(arrays, name=shard.name)

    def __len__(self) -> int:
        return self.arrays.num_samples

    @property
    def num_samples(self) -> int:
        """Samples in the shard."""
        return self.arrays.num_samples

    @property
    def has_doc_boundaries(self) -> bool:
        """Whether the shard stores its samples' document segments."""
        return self.arrays.has_doc_boundaries

    def _check_index(self, i: int) -> int:
        n = self.arrays.num_samples
        if not -n <= i < n:
            raise IndexError(f"sample {i} is out of range for shard {self.name} ({n} samples)")
        return i % n if n else i

    def tokens(self, i: int) -> np.ndarray:
        """Token ids of sample i (a read-only view, no copy)."""
        i = self._check_index(i)
        if self._tokens_2d is not None:
            return self._tokens_2d[i]
        offsets = self.arrays.sample_offsets
        return self.arrays.tokens[offsets[i]:offsets[i + 1]]

    def sample(self, i: int) -> Sample:
        """Sample i with its document segments (views, no copy)."""
        return self.arrays.sample(self._check_index(i))

    def gather(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Tokens of several fixed-length samples as one [k, length] array (one vectorised copy).

        Indices follow numpy rules like `tokens(i)`: -n <= i < n. This is the loader's hot path, so
        numpy's own bounds check does the work (explicit min/max reductions cost as much as the copy).

        Raises:
            IndexError: an index outside the shard (the message names the shard).
            ValueError: the shard holds variable-length samples.
        """
        if self._tokens_2d is None:
            raise ValueError(f"shard {self.name} holds variable-length samples; use tokens(i)")
        try:
            return self._tokens_2d[np.asarray(indices, dtype=np.int64)]
        except IndexError as err:
            raise IndexError(f"sample index out of range for shard {self.name} ({self.num_samples} samples): {err}") from None


def check_decoded(arrays: ShardArrays, shard: ShardInfo, *, vocab_size: int) -> None:
    """Raise `CorruptShardError` unless the decoded shard matches the manifest: its counts, and every token
    id below the tokenizer's `vocab_size` (an id outside the embedding table must stop here, naming the shard
    and sample, not as a device-side assert deep inside the model)."""
    if arrays.num_samples != shard.samples or arrays.tokens.size != shard.tokens:
        raise CorruptShardError(shard.name, f"holds {arrays.num_samples} samples / {arrays.tokens.size} tokens, "
                                            f"the manifest says {shard.samples} / {shard.tokens}")
    if arrays.has_doc_boundaries != shard.has_doc_boundaries:
        raise CorruptShardError(shard.name, "document boundaries present/absent contrary to the manifest")
    if arrays.tokens.size and int(arrays.tokens.max()) >= vocab_size:
        position = int(np.argmax(arrays.tokens >= vocab_size))
        sample = int(np.searchsorted(arrays.sample_offsets, position, side="right")) - 1
        raise CorruptShardError(shard.name, f"sample {sample} holds token id {int(arrays.tokens[position])}, outside "
                                            f"the tokenizer's vocabulary of {vocab_size} ids")
