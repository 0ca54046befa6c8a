"""Start-up storm: many simulated nodes x ranks start at once against the fault-injecting S3 proxy.

8 nodes x 4 ranks (world size 32) in CI, run two nodes at a time on the session's 8 pool processes (what
fits a 2-core machine in ~20 s); `SHARDKIT_STORM=64x8` runs the issue's 64 nodes x 8 ranks (one node at a
time, 4 shards per node; minutes). Each node has its own cache directory, as a real node has its own
disk, and tags its requests with a User-Agent suffix so the proxy can tell the nodes apart. The
proxy answers 10% of all requests with 503 SlowDown. Counted per node and object, among the
requests that reached the store: one GET of the manifest JSON, one of its binary index and one of its
shards' block indexes (`shardkit.blocks`), one GET of each shard the node's ranks read, none of any
other shard; every sample of the epoch is read exactly once over the 32 ranks.
"""

from __future__ import annotations

import os
import re
from collections import Counter

import pytest

from conftest import S3_TEST_CREDENTIALS
from fault_proxy import through_proxy
from loader_helpers import write_fixed
from storm_procs import storm_rank

from shardkit.block_indexes import BLOCK_INDEXES_NAME
from shardkit.manifest import INDEX_NAME, MANIFEST_NAME, load_manifest, write_manifest
from shardkit.storage import Storage


def _storm_size() -> tuple[int, int]:
    text = os.environ.get("SHARDKIT_STORM", "8x4")
    try:
        nodes, ranks = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"SHARDKIT_STORM must look like 64x8 (nodes x ranks per node), got {text!r}") from None
    return nodes, ranks


NODES, RANKS = _storm_size()
NODES_AT_ONCE, SHARDS = max(1, 8 // RANKS), 4 * NODES  # the pool has 8 processes

pytestmark = [pytest.mark.slow, pytest.mark.s3]


def test_storm_one_manifest_get_per_node_and_each_shard_once(faulty_bucket, process_pool, tmp_path, figures):
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
    assert len(ids) == len(set(ids)) == SHARDS * 32  # every sample once over all ranks

    gets: dict[int, Counter[str]] = {node: Counter() for node in range(NODES)}
    for method, key, agent, status in proxy.answered:
        match = re.search(r"storm-node-(\d+)", agent)
        if method == "GET" and status in (200, 206) and key.startswith("data/") and match:
            gets[int(match.group(1))][key.removeprefix("data/")] += 1
    for node, counts in gets.items():
        needed = {name for r in results[node] for name in r["shards"]}
        assert counts[MANIFEST_NAME] == counts[INDEX_NAME] == counts[BLOCK_INDEXES_NAME] == 1, (node, counts)
        shards = {name: n for name, n in counts.items() if name not in (MANIFEST_NAME, INDEX_NAME, BLOCK_INDEXES_NAME)}
        assert set(shards) == needed, (node, sorted(set(shards) ^ needed))
        assert max(shards.values()) == 1, (node, {k: v for k, v in shards.items() if v > 1})
    # The nodes split the data: each read about 1/NODES of the shards, not all of them.
    assert max(len(gets[node]) - 3 for node in gets) < SHARDS // 2
    shard_gets = [sum(counts.values()) - 3 for counts in gets.values()]
    figures.add(f"storm_{NODES}x{RANKS}", runs=1, nodes=NODES, ranks=NODES * RANKS, shards=SHARDS,
                samples_checked=len(ids), lost=SHARDS * 32 - len(set(ids)), duplicated=len(ids) - len(set(ids)),
                manifest_gets=sum(counts[MANIFEST_NAME] for counts in gets.values()),
                index_gets=sum(counts[INDEX_NAME] for counts in gets.values()),
                shard_gets=sum(shard_gets), max_shard_gets_per_node=max(shard_gets),
                slowdowns=proxy.counts["slowdown"])
