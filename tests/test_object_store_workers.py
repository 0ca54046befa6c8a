"""The object-store path (obstore) in DataLoader workers forked after their parent started obstore's runtime,
and the region of a bucket that nothing configures (issue 47), against moto's S3 server on loopback."""

from __future__ import annotations

import os

import numpy as np
import pytest

from loader_helpers import VOCAB, fixed_sample, ids_from_tokens
from process_tree import descendants
from shardkit import StreamingDataLoader, StreamingDataset
from shardkit.storage import Storage

pytest.importorskip("obstore")
pytestmark = pytest.mark.s3

RUNTIME_THREAD = "tokio-rt-worker"  # obstore's runtime threads: fork() copies none, so a child's are its own


def _runs_obstore(pid: int) -> bool:
    """Whether process `pid` started an obstore runtime of its own (s3fs, the fallback, starts none)."""
    names = set()
    for thread in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{thread}/comm") as comm:
                names.add(comm.read().strip())
        except FileNotFoundError:
            pass  # the thread ended meanwhile
    return RUNTIME_THREAD in names


@pytest.mark.slow
def test_dataloader_workers_read_s3_through_an_obstore_of_their_own(s3_bucket, tmp_path, monkeypatch):
    """The parent reads the manifest through obstore (its runtime starts), then forks 2 DataLoader workers: each
    reads its shards through a copy of obstore's extension with a runtime of its own (the copy the parent loaded
    for its children before the fork; before obstore's copies, they fell back to s3fs)."""
    from shardkit.formats import write_dataset
    from shardkit.manifest import TokenizerInfo

    monkeypatch.delenv("SHARDKIT_STORAGE_CLIENT", raising=False)  # the default client
    url, options = s3_bucket
    write_dataset(url, (fixed_sample(i, 65) for i in range(256)), seq_len=64, packing="concat", max_samples=32,
                  tokenizer=TokenizerInfo(kind="byte", name="test", vocab_size=VOCAB), storage_options=options)
    dataset = StreamingDataset(url, cache_dir=str(tmp_path / "cache"), storage_options=options, shuffle=False,
                               rank=0, world_size=1, prefetch=False)
    assert Storage(url, options).client == "obstore"
    import obstore._obstore

    from shardkit.object_store_runtime import obstore_module

    assert obstore_module() is obstore._obstore, "the parent runs the obstore it imported"
    # A step is a shard (32 samples, in order), and the workers take alternate steps: each worker reads shards of
    # its own from S3 (none finds the other's in the shared node cache).
    loader = StreamingDataLoader(dataset, batch_size=32, num_workers=2, multiprocessing_context="fork", timeout=60)
    others = set(descendants(os.getpid()))
    batches = iter(loader)
    ids = [next(batches)["sample_id"].numpy().copy()]
    workers = sorted(set(descendants(os.getpid())) - others)
    assert len(workers) == 2
    for batch in batches:
        assert np.array_equal(ids_from_tokens(batch["tokens"]), batch["sample_id"].numpy())
        ids.append(batch["sample_id"].numpy().copy())
        if workers and all(_runs_obstore(pid) for pid in workers):
            workers = []  # each worker read through a copy of its own, its runtime started there
    assert workers == [], "a worker read without loading obstore (the s3fs fallback)"
    assert sorted(np.concatenate(ids).tolist()) == list(range(256))
    assert all(dataset.caches[0].is_cached(shard) for shard in range(8)), "the workers filled the cache"


def test_a_bucket_outside_us_east_1_is_found_with_no_region_configured(s3_endpoint, tmp_path, monkeypatch):
    """No region in storage_options, the environment or a profile: obstore signs for the region S3 names in its
    HEAD bucket answer (x-amz-bucket-region), as s3fs finds it; a region given anywhere is taken as given."""
    import boto3

    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.delenv("SHARDKIT_STORAGE_CLIENT", raising=False)
    bucket = f"test-{os.urandom(6).hex()}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="eu-west-2").create_bucket(
        Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "eu-west-2"})
    storage = Storage(f"s3://{bucket}/data", {"endpoint_url": s3_endpoint})
    storage.write_bytes("r.bin", b"in london")
    assert storage.client == "obstore" and storage.objects.store.config["region"] == "eu-west-2"
    assert storage.read_bytes("r.bin") == b"in london"
    given = Storage(f"s3://{bucket}/data", {"endpoint_url": s3_endpoint, "client_kwargs": {"region_name": "eu-west-1"}})
    assert given.objects.store.config["region"] == "eu-west-1"
    monkeypatch.setenv("AWS_REGION", "ap-south-1")  # obstore reads the environment's itself: nothing is asked
    assert "region" not in Storage(f"s3://{bucket}/data", {"endpoint_url": s3_endpoint}).objects.store.config
