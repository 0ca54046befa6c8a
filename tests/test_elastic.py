"""Elastic training end to end with torchrun's own elastic agent: two simulated nodes on loopback.

Node A and node B each run `torchrun --nnodes 1:2 --rdzv-backend c10d` with their own node-local cache,
reading the dataset from S3 (moto behind the loopback proxy, which tells the nodes apart by their
User-Agent). Mid-epoch node B loses its whole process tree (SIGKILL): node A's agent re-forms the job
alone, and the trainer resumes from the newest checkpoint with the loader's elastic state and the model
resharded from 2 ranks to 1. Then node B starts again: the job scales back up at the next rendezvous
(node A's worker gets SIGTERM from its agent, saves a checkpoint and the group re-forms with 2 ranks).
Over the whole run every step's loss is logged once, no sample id is consumed twice within the epoch
and none is skipped, and each node fetches each shard it needs at most once.
"""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from elastic_nodes import lose_and_return, metric_records, world_changes
from fault_proxy import through_proxy
from train_runs import write_byte_dataset

pytestmark = [pytest.mark.slow, pytest.mark.s3]

SAMPLES, SEQ_LEN, PER_SHARD = 4000, 32, 100  # one epoch holds every step below (at most 8 samples a step)
STEPS, BATCH, EVERY = 360, 4, 10


def _ids_by_step(run_dir) -> dict[int, list[int]]:
    """The global sample ids each step consumed, over every rank's sample log."""
    by_step: dict[int, list[int]] = {}
    for path in sorted((run_dir / "samples").glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            by_step.setdefault(record["step"], []).extend(record["ids"])
    return by_step


def test_node_lost_and_returning_resumes_exactly(faulty_bucket, tmp_path):
    url, options, proxy = faulty_bucket
    options = through_proxy(options)
    # Format v1: a shard is one GET, so "fetched at most once" is a count of GETs per node and shard.
    write_byte_dataset(url, num_samples=SAMPLES, seq_len=SEQ_LEN, samples_per_shard=PER_SHARD,
                       storage_options=options, format_version=1)
    result = lose_and_return(tmp_path, data=url, storage_options=options, steps=STEPS, batch_size=BATCH,
                             checkpoint_every=EVERY)
    node_a, node_b = result["nodes"]
    run_dir = result["run_dir"]

    # Rank 0 reports the reshards: node a's worker while alone, either node's after the scale-up.
    logs = node_a.log() + node_b.log()
    assert sorted(world_changes(logs)) == [(1, 2), (2, 1)], logs[-4000:]
    # The scale-up came at a step boundary through the agent's SIGTERM: the trainer saved a checkpoint first.
    assert re.search(r"stopped by a signal after step \d+; checkpoint saved", node_a.log()), node_a.log()[-4000:]

    # Every step's loss once.
    loss_steps = [r["step"] for r in metric_records(run_dir) if "loss" in r]
    assert sorted(loss_steps) == list(range(1, STEPS + 1)), Counter(loss_steps).most_common(3)

    # Every step's samples: no id twice within the epoch, the global batch of the world size then in force.
    by_step = _ids_by_step(run_dir)
    assert sorted(by_step) == list(range(1, STEPS + 1))
    ids = [i for step in sorted(by_step) for i in by_step[step]]
    assert len(ids) == len(set(ids)), f"{len(ids) - len(set(ids))} sample ids consumed twice in one epoch"
    assert {len(v) for v in by_step.values()} <= {BATCH, 2 * BATCH}
    assert any(len(v) == BATCH for v in by_step.values()) and len(by_step[STEPS]) == 2 * BATCH
    # Nothing skipped: the ids consumed are the first ones of the epoch's global order. That order is fixed
    # by the partitions the job started with (one per node: 2) and kept across the membership changes, so a
    # single uninterrupted reader of the same dataset with 2 partitions reads the same set.
    from shardkit import StreamingDataLoader, StreamingDataset

    reference = StreamingDataLoader(StreamingDataset(url, storage_options=options, cache_dir=tmp_path / "cache-ref",
                                                     num_partitions=2), batch_size=BATCH)
    expected: list[int] = []
    for batch in reference:
        expected += batch["sample_id"].tolist()
        if len(expected) >= len(ids):
            break
    assert set(ids) == set(expected[:len(ids)]), "the run skipped samples of the epoch's order"

    # Each node fetched each shard it needed at most once (its node cache survives worker restarts).
    gets: dict[str, Counter[str]] = {"a": Counter(), "b": Counter()}
    for method, key, agent, status in proxy.answered:
        match = re.search(r"elastic-node-(\w)", agent)
        if method == "GET" and status in (200, 206) and match and key.rsplit("/", 1)[-1].startswith("shard-"):
            gets[match.group(1)][key] += 1
    assert gets["a"] and gets["b"]
    for node, counts in gets.items():
        assert max(counts.values()) == 1, (node, {k: v for k, v in counts.items() if v > 1})
