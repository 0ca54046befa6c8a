"""StreamingDataset: topology resolution, variable-length batches, mixtures (their resume: test_dataloader_resume.py),
and the per-node download volume of 4 simulated nodes x 2 ranks (separate caches, real processes, real S3)."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest
import torch

from conftest import S3_TEST_CREDENTIALS
from loader_helpers import ids_from_tokens, write_fixed, write_variable
from loader_procs import loader_run
from s3_proxy import CountingProxy
from shardkit import Stream, StreamingDataLoader, StreamingDataset
from shardkit.loaders.delivery.topology import resolve_topology


def test_topology_precedence(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert resolve_topology().world_size == 1
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    topo = resolve_topology()
    assert (topo.rank, topo.world_size, topo.local_rank, topo.num_nodes, topo.node) == (5, 8, 1, 2, 1)
    explicit = resolve_topology(rank=1, world_size=2)
    assert (explicit.rank, explicit.world_size, explicit.local_world_size) == (1, 2, 2)
    with pytest.raises(ValueError, match="rank 3"):
        resolve_topology(rank=3, world_size=2)
    with pytest.raises(ValueError, match="both rank and world_size"):
        resolve_topology(rank=1)


def test_rank_is_resolved_at_iteration_not_at_creation(tmp_path, monkeypatch):
    url = str(tmp_path / "ds")
    write_fixed(url, 100, per_shard=30)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ds = StreamingDataset(url, cache_dir=str(tmp_path / "c"))
    monkeypatch.setenv("RANK", "1")  # as if the launcher/process group appeared after creation
    monkeypatch.setenv("WORLD_SIZE", "2")
    loader = StreamingDataLoader(ds, batch_size=5)
    assert len(loader) == 10
    ids = torch.cat([b["sample_id"] for b in loader])
    rank0 = StreamingDataLoader(StreamingDataset(url, cache_dir=str(tmp_path / "c"), rank=0, world_size=2), 5)
    other = torch.cat([b["sample_id"] for b in rank0])
    assert len(set(ids.tolist()) | set(other.tolist())) == 100


def test_variable_length_batches_are_padded_with_lengths(tmp_path):
    url = str(tmp_path / "var")
    write_variable(url, 120, max_len=40)
    loader = StreamingDataLoader(StreamingDataset(url, cache_dir=str(tmp_path / "c"), segment_ids=True), batch_size=6)
    batches = list(loader)
    assert len(batches) == 20
    for batch in batches:
        tokens, lengths, seg = batch["tokens"].long(), batch["lengths"], batch["segment_ids"]
        assert tokens.shape[1] == int(lengths.max())
        for row, n, sid in zip(tokens, lengths, batch["sample_id"]):
            assert torch.all(row[:n] == sid % 60000) and torch.all(row[n:] == 0)
        assert torch.all((seg == -1) == (torch.arange(tokens.shape[1])[None, :] >= lengths[:, None]))


def test_mixture_follows_weights_and_refuses_other_weights(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_fixed(a, 400, per_shard=50)
    write_fixed(b, 100, per_shard=50, offset=400)
    streams = [Stream(a, weight=1), Stream(b, weight=3)]
    ds = StreamingDataset(streams, cache_dir=str(tmp_path / "c"), epoch_size=800, shuffle_window=50)
    loader = StreamingDataLoader(ds, batch_size=8)
    batches = list(loader)
    assert len(batches) == 100
    for batch in batches:
        ids = batch["sample_id"]
        np.testing.assert_array_equal(ids_from_tokens(batch["tokens"]), ids.numpy())
        from_b = int((ids >= 400).sum())
        assert abs(from_b - 6) <= 1  # stated tolerance for two streams: n * 3/4 +- 1 per run of n positions
    ids = torch.cat([b["sample_id"] for b in batches])
    assert int((ids >= 400).sum()) == 600  # exact over the epoch (800 positions x 3/4)
    # stream b (100 samples) cycles through 6 reshuffled epochs: each cycle covers it once
    first_cycle = ids[ids >= 400][:100]
    assert sorted(first_cycle.tolist()) == list(range(400, 500))
    wrong = StreamingDataset([Stream(a, weight=1), Stream(b, weight=2)], cache_dir=str(tmp_path / "c"),
                             epoch_size=800, shuffle_window=50)
    with pytest.raises(ValueError, match="dataset"):
        StreamingDataLoader(wrong, batch_size=8).load_state_dict(loader.state_dict())


@pytest.mark.slow
@pytest.mark.s3
def test_per_node_download_volume_four_nodes(process_pool, s3_bucket, s3_endpoint, tmp_path):
    url, options = s3_bucket
    manifest = write_fixed(url, 32 * 40, seq_len=64, per_shard=40, storage_options=options)
    total = sum(s.compressed_bytes for s in manifest.shards)
    report, measured = {}, {}
    for partitions in (None, 1):  # None: canonical partitions = nodes (4); 1: no locality, for contrast
        proxy = CountingProxy(s3_endpoint)
        try:
            kwargs = {"shuffle_window": 40, "local_world_size": 2}
            if partitions:
                kwargs["num_partitions"] = partitions
            results = process_pool.run(loader_run, [
                dict(url=url, cache_dir=str(tmp_path / f"p{partitions}" / f"node{r // 2}"), batch_size=4, rank=r,
                     world_size=8, env=S3_TEST_CREDENTIALS, storage_options={**options, "endpoint_url": proxy.url},
                     dataset_kwargs=kwargs) for r in range(8)])
        finally:
            proxy.close()
        per_node = collections.Counter()
        for r, result in enumerate(results):
            assert result["mismatched"] == 0
            per_node[r // 2] += result["stats"][0]["downloaded_bytes"]
        assert sum(per_node.values()) == sum(proxy.bytes_out[p] for p in proxy.gets(".tar"))
        report[f"partitions={partitions or 4}"] = {f"node{n}": round(per_node[n] / total, 3) for n in range(4)}
        measured[partitions] = [per_node[n] for n in range(4)]
    print("\nper-node download volume (fraction of the dataset):", json.dumps(report))
    # Exactly the shards the pure order gives the node's two ranks, each downloaded once per node: with
    # whole-shard blocks and 4 partitions of 8 shards, a quarter of the shards (not "at most" a share).
    expected = expected_node_shares(manifest, num_partitions=4, shuffle_window=40, world_size=8, batch_size=4,
                                    ranks_per_node=2)
    assert measured[None] == [nbytes for nbytes, _ in expected], report
    assert [count for _, count in expected] == [8] * 4
    assert sum(report["partitions=1"].values()) > sum(report["partitions=4"].values())


def expected_node_shares(manifest, *, num_partitions: int, shuffle_window: int, world_size: int, batch_size: int,
                         ranks_per_node: int) -> list[tuple[float, int]]:
    """(bytes, shard count) each node must download in epoch 0, from the pure order functions."""
    from shardkit.loaders.order.epochs import EpochOrder, OrderConfig
    from shardkit.loaders.order.partition import rank_positions, steps_in_epoch

    sizes = [s.samples for s in manifest.shards]
    order = EpochOrder(sizes, OrderConfig(num_partitions=num_partitions, shuffle_window=shuffle_window), 0)
    steps = steps_in_epoch(order.num_positions, start=0, global_batch=batch_size * world_size)
    ends = np.cumsum(sizes)
    shares = []
    for node in range(world_size // ranks_per_node):
        shards: set[int] = set()
        for rank in range(node * ranks_per_node, (node + 1) * ranks_per_node):
            positions = rank_positions(np.arange(steps), start=0, num_positions=order.num_positions,
                                       world_size=world_size, batch_size=batch_size, rank=rank,
                                       partition_of=order.partition_of)
            shards |= set(np.searchsorted(ends, order.sample_ids(positions).ravel(), side="right").tolist())
        shares.append((sum(manifest.shards[i].compressed_bytes for i in shards), len(shards)))
    return shares
