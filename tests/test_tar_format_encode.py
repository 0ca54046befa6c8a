"""The fast tar encoder writes exactly the bytes of the straightforward tarfile/np.save encoder."""

from __future__ import annotations

import numpy as np
import pytest

from shardkit.formats import Sample, arrays_from_samples, tar_format
from shardkit.formats.codec import compressor


def reference_encode(arrays, level):
    """Member by member with tarfile.TarInfo and numpy's write_array (the original implementation)."""
    cctx, out, raw = compressor(level), bytearray(), 0
    for i in range(arrays.num_samples):
        sample = arrays.sample(i)
        members = [("tokens", sample.tokens)]
        if sample.doc_starts is not None:
            members.append(("docs", np.stack([sample.doc_starts, sample.doc_source, sample.doc_index], axis=1)
                            .astype("<i8").reshape(-1, 3)))
        for field, array in members:
            payload = tar_format._npy_bytes(array)
            raw += len(payload)
            frame = cctx.compress(payload)
            out += tar_format._header(f"{i:09d}.{field}.npy.zst", len(frame)) + frame + b"\0" * (-len(frame) % 512)
    out += b"\0" * 1024
    out += b"\0" * (-len(out) % 10240)
    return bytes(out), raw


@pytest.mark.parametrize("token_dtype, vocab", [("uint16", 65536), ("uint32", 2**32)])
@pytest.mark.parametrize("docs", [True, False])
def test_fast_encoder_is_byte_identical(token_dtype, vocab, docs):
    rng = np.random.default_rng(7)
    samples = [Sample(np.zeros(0, dtype=np.uint32))] if not docs else []
    for i in range(120):
        n = int(rng.integers(1, 3000))
        tokens = rng.integers(0, vocab, n, dtype=np.uint64)
        if docs:
            k = min(int(rng.integers(1, 4)), n)
            starts = np.array([0, *sorted(rng.choice(np.arange(1, n), size=k - 1, replace=False))]) if n > 1 else [0]
            samples.append(Sample(tokens, starts, np.full(len(starts), i % 3 - 1), np.arange(len(starts)) + 2**40))
        else:
            samples.append(Sample(tokens))
    arrays = arrays_from_samples(samples, token_dtype)
    for level in (1, 3):
        assert tar_format.encode_tar(arrays, level=level) == reference_encode(arrays, level)
    empty = arrays_from_samples([], token_dtype)
    assert tar_format.encode_tar(empty, level=3) == reference_encode(empty, 3)
