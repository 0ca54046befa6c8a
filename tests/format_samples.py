"""Sample generators and readers shared by the shard-format tests."""

from __future__ import annotations

import numpy as np

from shardkit.formats import Sample, ShardReader, write_decoded
from shardkit.manifest import TokenizerInfo
from shardkit.storage import Storage


def make_samples(rng, count, vocab, *, fixed=None, docs=True):
    samples = []
    for i in range(count):
        n = fixed if fixed is not None else int(rng.integers(0, 3000))
        tokens = rng.integers(0, vocab, n)
        if not docs:
            samples.append(Sample(tokens))
            continue
        k = min(3, n)
        starts = np.array([0, *sorted(rng.choice(np.arange(1, n), size=k - 1, replace=False))]) if k else np.zeros(0, int)
        samples.append(Sample(tokens, starts, np.full(len(starts), i % 5), np.arange(len(starts)) + i))
    return samples

def tokenizer(vocab: int) -> TokenizerInfo:
    return TokenizerInfo(kind="byte", name="t", vocab_size=vocab)

def read_back(url, manifest, tmp_path, storage_options=None):
    """Every sample of the dataset, read through ShardReader.from_bytes and through the mmap cache."""
    storage = Storage(url, storage_options)
    direct, cached = [], []
    for shard in manifest.shards:
        reader = ShardReader.from_bytes(storage.read_bytes(shard.name), shard=shard, manifest=manifest)
        direct.extend(reader.sample(i) for i in range(len(reader)))
        path = str(tmp_path / (shard.name.replace("/", "_") + ".decoded"))
        write_decoded(path, reader.arrays)
        mapped = ShardReader.open_decoded(path, name=shard.name)
        cached.extend(mapped.sample(i) for i in range(len(mapped)))
    return direct, cached

def zst_npy(array: np.ndarray, *, allow_pickle: bool = False) -> bytes:
    import io

    import zstandard

    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=allow_pickle)
    return zstandard.ZstdCompressor().compress(buf.getvalue())

def build_tar(members) -> bytes:
    """members: (TarInfo kwargs, payload or None)."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for fields, payload in members:
            info = tarfile.TarInfo(fields.pop("name"))
            for key, value in fields.items():
                setattr(info, key, value)
            if payload is not None:
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
            else:
                tar.addfile(info)
    return buf.getvalue()
