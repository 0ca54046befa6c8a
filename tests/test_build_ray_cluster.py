"""`shardkit build --executor ray` across the nodes of a real Ray cluster on this machine
(`ray.cluster_utils.Cluster`: a head without CPUs and two worker nodes, each its own raylet), with the
inputs and the output on the fault-injecting S3 server. A worker node is killed mid-build (its raylet and
workers, no goodbye): Ray runs its units again elsewhere and the build's output is byte-identical to the
local executor's, its accounting adds up (every input document counted once), and the report says which
node tokenized how many units."""

from __future__ import annotations

import threading
import time

import pytest

from conftest import in_fresh_process
from fault_proxy import through_proxy
from shardkit.manifest import MANIFEST_NAME
from shardkit.storage import Storage
from shardkit.tools.build import run_build
from test_build import config, write_corpus

pytestmark = [pytest.mark.slow, pytest.mark.s3]

DOCS = 1500


def _upload(directory, url: str, options: dict) -> list[str]:
    storage = Storage(url, options)
    names = []
    for path in sorted(directory.iterdir()):
        storage.write_bytes(path.name, path.read_bytes())
        names.append(f"{url}/{path.name}")
    return names


def test_build_across_ray_nodes_survives_a_lost_node(faulty_bucket, tmp_path):
    pytest.importorskip("ray", reason="the ray executor needs ray (pip install 'shardkit[ray]')")

    url, options, proxy = faulty_bucket
    options = through_proxy(options)
    inputs = _upload(write_corpus(tmp_path / "in", docs=DOCS, bad=True), f"{url}/in", options)
    settings = dict(storage_options=options, shard_size=40_000, unit_bytes=2048, packing="bestfit")
    local = run_build(config(inputs, f"{url}/local", workers=2, **settings))

    proxy.configure(rate=0.05, seed=3, kinds=("slowdown", "error500"))  # a flaky store for the Ray build
    # Ray runs in a spawned process: its core worker and gRPC leave threads behind after shutdown, which a later
    # test of this pytest-xdist worker that forks (DataLoader workers) would copy mid-operation.
    outcome = in_fresh_process(_build_losing_a_node, inputs, url, options, settings)
    if "error" in outcome:
        raise AssertionError(outcome["error"])
    assert proxy.injected > 0  # the store was flaky during the Ray build too

    ray_report, ray_shards = outcome["report"], outcome["shards"]
    output = Storage(f"{url}/ray", options)  # a fresh one: s3fs would answer from the listing cached above
    assert output.read_bytes(MANIFEST_NAME) == Storage(f"{url}/local", options).read_bytes(MANIFEST_NAME)
    for name in ray_shards:
        assert output.read_bytes(name) == Storage(f"{url}/local", options).read_bytes(name)
    documents = ray_report["documents"]
    assert documents["balanced"] and documents == local.report["documents"] and documents["in"] > DOCS
    nodes = {name.rpartition("/")[2]: count for name, count in ray_report["timing"]["units_per_node"].items()}
    # The survivor tokenized units; the lost node is named too if a unit it ran was consumed before its loss (on a
    # loaded machine its worker may not have started by then); the head, without a CPU, ran none.
    survivor, lost = (node_id[:8] for node_id in outcome["worker_nodes"])
    assert survivor in nodes and set(nodes) <= {survivor, lost}, (nodes, outcome["worker_nodes"])
    # Every unit's result was consumed once, whichever node ran it last.
    assert sum(nodes.values()) == sum(local.report["timing"]["units_per_node"].values())


def _build_losing_a_node(inputs: list[str], url: str, options: dict, settings: dict) -> dict:
    """The Ray build on a cluster of this machine (a head without CPUs and two worker nodes), one node killed
    once the build has written a shard: its report and shard names, or the error (as text) that stopped it."""
    from ray.cluster_utils import Cluster

    # Simulated nodes: raylets of this machine (Ray binds them to this machine's own address).
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    outcome: dict = {}
    try:
        doomed, survivor = cluster.add_node(num_cpus=1), cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        outcome["worker_nodes"] = [survivor.node_id, doomed.node_id]

        def build() -> None:
            try:
                result = run_build(config(inputs, f"{url}/ray", workers=2, executor="ray",
                                          ray_address=cluster.address, **settings))
                outcome.update(report=result.report, shards=[shard.name for shard in result.manifest.shards])
            except BaseException as err:  # noqa: BLE001 - reported to the test process below
                outcome["error"] = f"{type(err).__name__}: {err}"

        thread = threading.Thread(target=build)
        thread.start()
        output = Storage(f"{url}/ray", options)
        deadline = time.monotonic() + 240
        while not any(name.startswith("shard-") for name in output.list_names()):  # the build is under way
            if not thread.is_alive() or time.monotonic() > deadline:
                return {"error": outcome.get("error", "the build did not start")}
            time.sleep(0.05)
        if not thread.is_alive():
            return {"error": "the build ended before a node could be lost: make the corpus larger"}
        cluster.remove_node(doomed, allow_graceful=False)
        thread.join(timeout=300)
        if thread.is_alive():
            return {"error": "the build did not finish after the node was lost"}
    finally:
        cluster.shutdown()
    return outcome
