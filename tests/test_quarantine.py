"""Quarantine of corrupt shards (loaders/order/quarantine.py): agreed over a real gloo group, exact, balanced,
resumable; `shardkit verify --quarantine-list` and a run that takes the list up front."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from conftest import S3_TEST_CREDENTIALS, free_port, s3_options
from fault_proxy import FaultProxy, through_proxy
from loader_helpers import write_fixed
from quarantine_procs import quarantine_run

SAMPLES = 610  # 12 shards of 48 and a last one of 34
PER_SHARD = 48
BATCH = 4
# Two nodes of one rank each: two cache directories, two views of the store.
TWO_NODES = {"local_rank": 0, "local_world_size": 1, "on_corrupt": "skip", "shuffle_window": 100, "seed": 5, "partial_batches": "partial",
             "chunk_samples": 64}


class CorruptingProxy(FaultProxy):
    """The store as one node sees it: every GET of the object named `corrupt` has one bit flipped (so
    the re-read fails too); everything else passes through untouched."""

    corrupt: str | None = None

    def _plan(self, method, target, range_header):
        rng = random.Random(0)
        if self.corrupt is not None and method == "GET" and self.corrupt in target:
            return rng, "flip"
        return rng, None


@pytest.fixture(scope="module")
def store(s3_endpoint, tmp_path_factory):
    """A dataset on moto S3, read by rank 0 directly and by rank 1 through a corrupting proxy."""
    pytest.importorskip("s3fs")
    import uuid

    import boto3

    bucket = f"quarantine-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    options = s3_options(s3_endpoint)
    manifest = write_fixed(f"s3://{bucket}/data", SAMPLES, seq_len=8, per_shard=PER_SHARD, storage_options=options)
    proxy = CorruptingProxy(s3_endpoint)
    try:
        yield {"url": f"s3://{bucket}/data", "direct": options, "manifest": manifest, "proxy": proxy,
               "through": through_proxy({**options, "endpoint_url": proxy.url}, checksums=False),
               "root": tmp_path_factory.mktemp("quarantine")}
    finally:
        proxy.close()


def run_two_nodes(pool, store, run: str, **kwargs) -> list[dict]:
    """Rank 0 reads the store directly, rank 1 through the proxy; each node has its own cache."""
    port = free_port()
    dataset_kwargs = {**TWO_NODES, **kwargs.pop("dataset_kwargs", {})}
    tasks = [dict(url=store["url"], cache_dir=str(store["root"] / run / f"node{rank}"), batch_size=BATCH, rank=rank,
                  world_size=2, port=port, env=S3_TEST_CREDENTIALS, dataset_kwargs=dataset_kwargs,
                  storage_options=store["direct"] if rank == 0 else store["through"], **kwargs) for rank in range(2)]
    return pool.run(quarantine_run, tasks, timeout=240)


def flat(result) -> np.ndarray:
    return np.concatenate(result["ids"]) if result["ids"] else np.zeros(0, np.int64)


def shard_range(index: int) -> set[int]:
    return set(range(index * PER_SHARD, min((index + 1) * PER_SHARD, SAMPLES)))


pytestmark = pytest.mark.slow


def test_shard_corrupt_on_one_node_is_skipped_on_every_rank(process_pool, store, figures):
    from shardkit.loaders.order.epochs import epoch_order

    # Corrupt a shard of the partition that only rank 1's node reads (two nodes: two canonical partitions),
    # so no sample of it is read before the ranks agree: the epoch must hold every other sample once.
    sizes = [shard.samples for shard in store["manifest"].shards]
    order = epoch_order(sizes, seed=TWO_NODES["seed"], num_partitions=2, shuffle_window=TWO_NODES["shuffle_window"])
    positions = np.arange(SAMPLES)
    shard_of = np.searchsorted(np.cumsum(sizes), order.sample_ids(positions), side="right")
    victim = next(i for i in range(len(sizes)) if np.all(order.partition_of(positions[shard_of == i]) == 1))
    name = store["manifest"].shards[victim].name
    store["proxy"].corrupt = name
    runs = run_two_nodes(process_pool, store, "corrupt")
    assert runs[0]["steps_per_rank"] == runs[1]["steps_per_rank"] == [len(runs[0]["ids"])] * 2
    assert runs[0]["len"] == len(runs[0]["ids"]), "len(loader) counts the epoch without the quarantined shard"
    assert all(r["mismatched"] == 0 for r in runs)
    seen = np.concatenate([flat(r) for r in runs])
    assert len(np.unique(seen)) == len(seen), "a sample came twice"
    assert set(seen.tolist()) == set(range(SAMPLES)) - shard_range(victim)
    assert runs[0]["state"] == runs[1]["state"]
    assert [q[0] for q in runs[0]["state"]["quarantine"]] == [victim]
    # Both ranks log it, naming the shard's URL and the samples skipped, and count them.
    for r in runs:
        assert any(name in w and f"{PER_SHARD} of its samples" in w for w in r["warnings"]), r["warnings"]
        assert r["quarantined_samples"] == PER_SHARD
    # Only rank 1's node saw the corruption.
    assert "corrupt on rank 1" in runs[0]["warnings"][0]

    # Exact resume after the quarantine: the state carries it; rank 1's node still sees the bad shard.
    first = run_two_nodes(process_pool, store, "resume", limit=50)
    assert [q[0] for q in first[0]["state"]["quarantine"]] == [victim]
    # (the resumed run reads through 2 DataLoader workers, restarted at every checked segment)
    second = run_two_nodes(process_pool, store, "resume", state=first[0]["state"], num_workers=2)
    for rank in range(2):
        np.testing.assert_array_equal(np.concatenate([flat(first[rank]), flat(second[rank])]), flat(runs[rank]))
    wanted = set(range(SAMPLES)) - shard_range(victim)
    figures.add("quarantine_one_node", runs=3, samples_checked=len(seen), lost=len(wanted - set(seen.tolist())),
                duplicated=len(seen) - len(np.unique(seen)), corrupt=sum(r["mismatched"] for r in runs),
                quarantined_samples_per_rank=runs[0]["quarantined_samples"],
                steps_per_rank=runs[0]["steps_per_rank"][0])


def test_on_corrupt_raise_names_the_shard(store, tmp_path, figures):
    from shardkit import StreamingDataLoader, StreamingDataset
    from shardkit.errors import CorruptShardError

    name = store["manifest"].shards[0].name  # the first shard read: fails at once
    store["proxy"].corrupt = name
    dataset = StreamingDataset(store["url"], cache_dir=str(tmp_path / "cache"), storage_options=store["through"],
                               shuffle=False, prefetch=False)
    with pytest.raises(CorruptShardError, match=name) as raised:
        for _ in StreamingDataLoader(dataset, batch_size=BATCH):
            pass
    figures.add("quarantine_raise", runs=1, error_names_shard=int(name in str(raised.value)))


def test_quarantine_list_round_trip(tmp_path, figures):
    from shardkit.cli.main import main
    from loader_procs import loader_run

    url = str(tmp_path / "data")
    manifest = write_fixed(url, SAMPLES, seq_len=8, per_shard=PER_SHARD)
    bad = [2, 7]
    for index in bad:  # flip a byte in the middle of the stored shard
        path = tmp_path / "data" / manifest.shards[index].name
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
    listing = tmp_path / "bad.json"
    assert main(["verify", url, "--quarantine-list", str(listing), "--no-progress"]) == 1
    written = json.loads(listing.read_text())
    assert [s["name"] for s in written["shards"]] == [manifest.shards[i].name for i in bad]
    # The run leaves them out from the start, exactly and balanced (on_corrupt stays "raise": never read).
    kwargs = {"shuffle_window": 100, "seed": 3, "partial_batches": "partial", "quarantine_list": str(listing)}
    runs = [loader_run(url=url, cache_dir=str(tmp_path / "cache"), batch_size=BATCH, rank=r, world_size=2,
                       dataset_kwargs=kwargs) for r in range(2)]
    assert len(runs[0]["ids"]) == len(runs[1]["ids"]) == runs[0]["len"]
    seen = np.concatenate([flat(r) for r in runs])
    assert len(np.unique(seen)) == len(seen)
    assert set(seen.tolist()) == set(range(SAMPLES)) - shard_range(2) - shard_range(7)
    assert sorted(q[0] for q in runs[0]["state"]["quarantine"]) == bad
    wanted = set(range(SAMPLES)) - shard_range(2) - shard_range(7)
    figures.add("quarantine_list", runs=1, samples_checked=len(seen), lost=len(wanted - set(seen.tolist())),
                duplicated=len(seen) - len(np.unique(seen)), listed=len(written["shards"]))
    # A list that names a shard of another dataset is refused, naming it.
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**written, "shards": [{"name": "shard-x.tar", "sha256": "0" * 64}]}))
    with pytest.raises(ValueError, match="shard-x.tar"):
        loader_run(url=url, cache_dir=str(tmp_path / "cache"), batch_size=BATCH, rank=0, world_size=1,
                   dataset_kwargs={"quarantine_list": str(other)})


def test_filtered_order_drops_exactly_the_quarantined_positions():
    from shardkit.loaders.order.epochs import epoch_order
    from shardkit.loaders.order.quarantine import filter_order

    sizes = [48] * 12 + [34]
    order = epoch_order(sizes, seed=1, num_partitions=2, shuffle_window=50)
    ends = np.cumsum(sizes)
    all_ids = order.sample_ids(np.arange(order.num_positions))
    shard = np.searchsorted(ends, all_ids, side="right")
    cut = int(np.median(np.flatnonzero(shard == 9)))  # half of shard 9 was read before it was quarantined
    # shard 4 from the start of epoch 0, shard 9 from position `cut` of epoch 0
    filtered = filter_order(order, ends, [(4, 0, 0), (9, 0, cut)], epoch=0)
    keep = ~((shard == 4) | ((shard == 9) & (np.arange(len(all_ids)) >= cut)))
    assert 0 < np.sum(keep & (shard == 9)) < 48
    np.testing.assert_array_equal(filtered.sample_ids(np.arange(filtered.num_positions)), all_ids[keep])
    # a later epoch excludes both from its start; an entry of a later epoch does not apply yet
    assert filter_order(order, ends, [(4, 0, 0), (9, 0, cut)], epoch=1).num_positions == order.num_positions - 96
    assert filter_order(order, ends, [(4, 1, 0)], epoch=0) is order


def test_every_shard_quarantined_says_so_and_names_the_list_or_the_check(tmp_path):
    """Issue 25 item 15: not 'the dataset is smaller than one global batch'."""
    from shardkit import StreamingDataLoader, StreamingDataset
    from shardkit.cli.main import main

    url = str(tmp_path / "data")
    manifest = write_fixed(url, 96, seq_len=8, per_shard=32)
    for shard in manifest.shards:  # every stored shard damaged
        path = tmp_path / "data" / shard.name
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
    listing = tmp_path / "bad.json"
    assert main(["verify", url, "--quarantine-list", str(listing), "--no-progress"]) == 1

    def loader(name, **options):
        return StreamingDataLoader(StreamingDataset(url, cache_dir=str(tmp_path / name), rank=0, world_size=1,
                                                    **options), batch_size=4)

    with pytest.raises(ValueError, match=rf"every shard of the dataset \(3 shards\) was quarantined.*3 by "
                                         rf"quarantine_list {listing}"):
        list(loader("listed", quarantine_list=str(listing)))
    with pytest.raises(ValueError, match=r"every shard of the dataset \(3 shards\) was quarantined.*3 by "
                                         r"on_corrupt='skip' checks \(first: corrupt on rank 0: "):
        list(loader("checked", on_corrupt="skip"))
