"""Start-up storm: many simulated nodes x ranks start at once against the fault-injecting S3 proxy.

8 nodes x 4 ranks (world size 32), run two nodes at a time on the session's 8 pool processes (what
fits a 2-core machine in ~20 s); each node has its own cache directory, as a real node has its own
disk, and tags its requests with a User-Agent suffix so the proxy can tell the nodes apart. The
proxy answers 10% of all requests with 503 SlowDown. Counted per node and object, among the
requests that reached the store: one GET of the manifest JSON and one of its binary index, one GET
of each shard the node's ranks read, none of any other shard; every sample of the epoch is read
exactly once over the 32 ranks.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

from conftest import S3_TEST_CREDENTIALS
from fault_proxy import through_proxy
from loader_helpers import write_fixed
from storm_procs import storm_rank

from shardkit.manifest import INDEX_NAME, MANIFEST_NAME, load_manifest, write_manifest
from shardkit.storage import Storage

NODES, RANKS, NODES_AT_ONCE, SHARDS = 8, 4, 2, 32

pytestmark = [pytest.mark.slow, pytest.mark.s3]


def test_storm_one_manifest_get_per_node_and_each_shard_once(faulty_bucket, process_pool, tmp_path):
    url, options, proxy = faulty_bucket
    options = through_proxy(options)
    write_fixed(url, SHARDS * 32, seq_len=8, per_shard=32, storage_options=options, docs=False)
    storage = Storage(url, options)
    write_manifest(storage, load_manifest(storage), index=True)  # the index travels like the JSON
    proxy.configure(rate=0.1, seed=1, kinds=("slowdown",))

    results: dict[int, list[dict]] = {}
    for first in range(0, NODES, NODES_AT_ONCE):
        batch = [dict(url=url, options=options, node=node, rank=node * RANKS + local, world_size=NODES * RANKS,
                      local_rank=local, local_world_size=RANKS, cache_dir=str(tmp_path / f"node-{node}"),
                      batch_size=2, env=S3_TEST_CREDENTIALS)
                 for node in range(first, first + NODES_AT_ONCE) for local in range(RANKS)]
        for kwargs, result in zip(batch, process_pool.run(storm_rank, batch, timeout=180)):
            results.setdefault(kwargs["node"], []).append(result)

    assert proxy.counts["slowdown"] > 0  # throttled, backed off, and every rank still finished
    ids = [i for ranks in results.values() for r in ranks for i in r["ids"]]
    assert len(ids) == len(set(ids)) == SHARDS * 32  # every sample once over the 32 ranks

    gets: dict[int, Counter[str]] = {node: Counter() for node in range(NODES)}
    for method, key, agent, status in proxy.answered:
        match = re.search(r"storm-node-(\d+)", agent)
        if method == "GET" and status in (200, 206) and key.startswith("data/") and match:
            gets[int(match.group(1))][key.removeprefix("data/")] += 1
    for node, counts in gets.items():
        needed = {name for r in results[node] for name in r["shards"]}
        assert counts[MANIFEST_NAME] == 1 and counts[INDEX_NAME] == 1, (node, counts)
        shards = {name: n for name, n in counts.items() if name not in (MANIFEST_NAME, INDEX_NAME)}
        assert set(shards) == needed, (node, sorted(set(shards) ^ needed))
        assert max(shards.values()) == 1, (node, {k: v for k, v in shards.items() if v > 1})
    # The nodes split the data: each read about 1/8 of the shards, not all of them.
    assert max(len(gets[node]) - 2 for node in gets) < SHARDS // 2
