"""The build (upload path) and the loader (download path) through the fault-injecting S3 proxy:
at 10% and 30% injected faults the build ends with the fault-free manifest and shard hashes, and
the loader yields exactly the fault-free sample stream."""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import pytest

from fault_proxy import through_proxy
from shardkit.manifest import load_manifest
from shardkit.storage import Storage


# The build on the default client (obstore where installed), the loader on both; tests/test_faults.py runs the
# core's fault tests on both.
pytestmark = [pytest.mark.s3, pytest.mark.slow]

WORDS = "the of and to in is was for on that with as by at from his her it an were are which be this".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    rng = random.Random(0)
    with open(path, "w") as fh:
        for _ in range(1200):
            fh.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 120)))}) + "\n")
    return path


def build(corpus, output: str, options: dict, shard_format: str):
    from shardkit.tools.build import BuildConfig, run_build

    config = BuildConfig(inputs=(str(corpus),), output=output, tokenizer="byte", seq_len=127, shard_format=shard_format,
                         shard_size=40_000, unit_bytes=64 * 1024, workers=1, progress=False,
                         storage_options=options)
    return run_build(config).manifest


@pytest.mark.parametrize("shard_format,rate", [("tar", 0.1), ("arrow", 0.3)])
def test_build_under_faults_matches_fault_free(faulty_bucket, corpus, shard_format, rate, figures):
    url, options, proxy = faulty_bucket
    options = through_proxy(options)
    clean = build(corpus, f"{url}/clean", options, shard_format)
    proxy.configure(rate=rate, seed=61)
    faulty = build(corpus, f"{url}/faulty", options, shard_format)
    injected = proxy.injected
    proxy.configure(rate=0.0)
    assert injected > 0
    assert faulty.to_json() == clean.to_json()
    # The stored objects are the ones the manifest names, byte for byte.
    storage = Storage(f"{url}/faulty", options)
    assert load_manifest(storage) == clean
    for shard in faulty.shards:
        import hashlib
        assert hashlib.sha256(storage.read_bytes(shard.name)).hexdigest() == shard.sha256
    assert not [n for n in storage.list_names() if ".tmp-" in n or n.startswith("_build/")]
    figures.add(f"build_upload_{int(rate * 100)}pct", runs=1, faults=injected, samples_checked=faulty.num_samples,
                shards_checked=len(faulty.shards), lost=0, duplicated=0, corrupt=0)


def stream(url: str, options: dict, cache_dir: str, epochs: int = 1) -> tuple[np.ndarray, np.ndarray]:
    from shardkit import StreamingDataLoader, StreamingDataset

    dataset = StreamingDataset(url, storage_options=options, cache_dir=cache_dir, shuffle=True, seed=3,
                               rank=0, world_size=1, local_rank=0, local_world_size=1, shuffle_window=64)
    loader = StreamingDataLoader(dataset, batch_size=8)
    ids, tokens = [], []
    for _ in range(epochs):
        for batch in loader:
            ids.append(batch["sample_id"].numpy())
            tokens.append(batch["tokens"].numpy())
    return np.concatenate(ids), np.concatenate(tokens)


@pytest.mark.parametrize("client,rate", [("obstore", 0.1), ("obstore", 0.3), ("fsspec", 0.3)])
def test_loader_under_faults_yields_the_fault_free_stream(faulty_bucket, tmp_path, client, rate, figures, caplog,
                                                          monkeypatch):
    from loader_helpers import write_fixed

    if client == "obstore":
        pytest.importorskip("obstore")
    monkeypatch.setenv("SHARDKIT_STORAGE_CLIENT", client)
    url, options, proxy = faulty_bucket
    # No transport checksums (botocore's, and obstore's ETag check, which the same option turns off): flipped
    # bodies reach the loader's own fetch (read_shard), which reads them again, on both clients.
    options = through_proxy(options, checksums=False)
    assert Storage(url, options).client == client
    manifest = write_fixed(url, 600, seq_len=31, per_shard=10, storage_options=options)
    clean_ids, clean_tokens = stream(url, options, str(tmp_path / "clean-cache"))
    proxy.configure(rate=rate, seed=71)
    with caplog.at_level(logging.WARNING, logger="shardkit.formats.fetch"):
        ids, tokens = stream(url, options, str(tmp_path / "faulty-cache"))
    injected, flips = proxy.injected, proxy.snapshot().get("flip", 0)
    proxy.configure(rate=0.0)
    rereads = sum("failed its check" in r.getMessage() for r in caplog.records)
    # Each failed check is explained by a flipped body (never a false alarm); the deterministic
    # tests/test_faults.py::test_one_bad_read_is_read_again_by_every_reader makes sure flips reach it.
    assert injected > 0 and rereads <= flips
    assert np.array_equal(ids, clean_ids) and np.array_equal(tokens, clean_tokens)
    # Exactly once: every sample of the epoch (the ragged tail is dropped by policy).
    assert len(np.unique(ids)) == len(ids) == manifest.num_samples - manifest.num_samples % 8
    # The tokens encode the sample id (loader_helpers.fixed_sample): nothing silently corrupted.
    expected = (np.arange(32)[None, :] * 7 + ids[:, None]) % 60000
    expected[:, 0], expected[:, 1] = ids % 60000, ids // 60000
    corrupt = int((tokens != expected).any(axis=1).sum())
    assert corrupt == 0
    figures.add(f"loader_download_{int(rate * 100)}pct" + ("_fsspec" if client == "fsspec" else ""), runs=1, faults=injected, samples_checked=len(ids),
                lost=manifest.num_samples - manifest.num_samples % 8 - len(np.unique(ids)),
                duplicated=len(ids) - len(np.unique(ids)), corrupt=corrupt, flips=flips, rereads=rereads)
