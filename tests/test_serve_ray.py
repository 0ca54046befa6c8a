"""`shardkit serve --ray`: the service's workers as Ray actors on a Ray cluster of this machine
(`ray.cluster_utils.Cluster`: a head without CPUs and two worker nodes), one worker node killed mid-run; the
consumer reads the in-process batches throughout. Ray runs in a fresh process (tests/conftest.py's
`in_fresh_process` says why)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import in_fresh_process
from resume_contract import take
from shardkit.serve.data import DataSpec
from test_serve import RAW, data, in_process  # noqa: F401 - the module's data fixture

pytestmark = pytest.mark.slow


def _serve_on_ray_losing_a_node(spec_json: str) -> dict:
    import os
    import signal
    import time

    import ray
    from ray.cluster_utils import Cluster

    from resume_contract import batch_ids
    from shardkit.loaders import StreamingDataLoader, StreamingDataset
    from shardkit.serve.data import DataSpec
    from shardkit.serve.local import LocalService

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        nodes = [cluster.add_node(num_cpus=1), cluster.add_node(num_cpus=1)]
        cluster.wait_for_nodes()
        cluster.connect()  # the driver on the head, which is never removed
        with LocalService(DataSpec.from_json(spec_json), workers=2, ray_address=cluster.address) as service:
            service.wait_for_workers(2)
            loader = StreamingDataLoader(StreamingDataset(None, service=service.url, service_timeout=120),
                                         batch_size=8)
            it = iter(loader)
            got = [batch_ids(next(it)) for _ in range(2)]
            busy = [w for w in service.workers() if w["load"].get("streams")] or service.workers()
            # A worker node goes; the serving worker's process is SIGKILLed too: on a simulated node a worker
            # process may outlive its raylet for a while, and elsewhere Ray restarts it.
            cluster.remove_node(nodes[0], allow_graceful=False)
            try:
                os.kill(busy[0]["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
            got += [batch_ids(next(it)) for _ in range(300)]  # past what gRPC had buffered before the loss
            time.sleep(0.1)
            return {"batches": [b.tolist() for b in got], "reassignments": loader.feed.reassignments}
    finally:
        ray.shutdown()  # the driver first: the cluster's shutdown removes the head it is connected to
        cluster.shutdown()


def test_ray_workers_serve_through_the_loss_of_a_node(data):
    # Long samples: gRPC lets a worker run megabytes ahead, the loss must come before the consumer has it all.
    spec = DataSpec(source=str(data / "a"), options={**RAW, "seq_len": 2048})
    outcome = in_fresh_process(_serve_on_ray_losing_a_node, spec.to_json())
    want = take(in_process(spec, batch_size=8)(0, 1), 302)
    np.testing.assert_array_equal(np.array(outcome["batches"]), np.array(want))
    assert outcome["reassignments"] >= 1, outcome["reassignments"]
