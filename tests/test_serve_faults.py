"""`shardkit serve` under faults, with real worker processes: a worker SIGKILLed mid-run, and a raw-text job of 2
gloo ranks resumed on 3 through the service. What every rank receives stays the in-process loader's."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from conftest import free_port
from resume_contract import batch_ids, save, take
from shardkit.loaders import StreamingDataLoader, StreamingDataset
from shardkit.serve.data import DataSpec
from shardkit.serve.local import LocalService
from test_serve import data, in_process, served, spec_of  # noqa: F401 - the module's data fixture

pytestmark = pytest.mark.slow


def busy_worker(service: LocalService, timeout: float = 10.0) -> dict:
    """A live worker with a stream open (its heartbeat says so within half a second)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = [w for w in service.workers() if w["load"].get("streams")]
        if busy:
            return busy[0]
        time.sleep(0.1)
    raise AssertionError(f"no worker reports an open stream: {service.workers()}")


@pytest.fixture(scope="module")
def long_built(tmp_path_factory):
    """Built data whose epoch (about 20 MB, 300 batches of 4) outlasts what gRPC and the sockets let a worker send
    ahead on loopback (a few MB, more on a quiet machine: at 2.5 MB the whole epoch was once sent before the kill
    and nothing was left to reassign): a worker killed after 8 batches still has a stream open."""
    from loader_helpers import write_fixed

    root = tmp_path_factory.mktemp("long")
    write_fixed(str(root / "built"), 1200, seq_len=8191, per_shard=200)
    return DataSpec(source=str(root / "built"), options={"cache_dir": str(root / "cache")})


@pytest.mark.parametrize("kind", ["built", "raw"])
def test_a_worker_killed_mid_run_loses_and_repeats_nothing(data, kind, request):
    spec = request.getfixturevalue("long_built") if kind == "built" else spec_of(data, kind)
    with LocalService(spec, workers=2) as service:
        service.wait_for_workers(2)
        loader = served(service.url)(0, 1)
        batches = iter(loader)
        got = [next(batches) for _ in range(8)]
        victim = busy_worker(service)
        os.kill(victim["pid"], signal.SIGKILL)
        # Read on until the broken stream was noticed: gRPC and the sockets may have let the worker send many
        # batches ahead (raw text's small batches: hundreds); built data up to its epoch's end, raw text's endless
        # lanes up to a cap far beyond what can be in flight.
        cap = 300 if kind == "built" else 5000
        while len(got) < 30 or (loader.feed.reassignments == 0 and len(got) < cap):
            got.append(next(batches))
        want = take(in_process(spec)(0, 1), len(got))
        for step, (g, w) in enumerate(zip(got, want)):
            np.testing.assert_array_equal(batch_ids(g), w, err_msg=f"{kind}, step {step}")
        assert loader.feed.reassignments >= 1
        deadline = time.monotonic() + 10  # its heartbeats stopped: the dispatcher drops it within 3 s
        while victim["id"] in {w["id"] for w in service.workers()} and time.monotonic() < deadline:
            time.sleep(0.2)
        assert victim["id"] not in {w["id"] for w in service.workers()}


def test_raw_text_of_two_gloo_ranks_resumes_on_three_through_the_service(data, process_pool):
    from serve_procs import served_rank_run

    spec = spec_of(data, "raw")
    with LocalService(spec, workers=2) as service:
        service.wait_for_workers(2)
        port = free_port()
        first = process_pool.run(served_rank_run, [dict(url=service.url, rank=r, world_size=2, port=port, steps=5,
                                                        batch_size=4) for r in range(2)])
        state = first[0]["state"]
        assert first[1]["state"] == state  # gathered: the same global state on every rank
        port = free_port()
        after = process_pool.run(served_rank_run, [dict(url=service.url, rank=r, world_size=3, port=port, steps=6,
                                                        batch_size=4, state=state) for r in range(3)])
    ranks = [in_process(spec)(r, 2) for r in range(2)]
    want_first = [take(loader, 5) for loader in ranks]
    assert save(ranks) == state
    for rank in range(2):
        np.testing.assert_array_equal(np.array(first[rank]["batches"]), np.array(want_first[rank]))
    for rank in range(3):
        resumed = in_process(spec)(rank, 3)
        resumed.load_state_dict(state)
        np.testing.assert_array_equal(np.array(after[rank]["batches"]), np.array(take(resumed, 6)),
                                      err_msg=f"rank {rank} of 3")
