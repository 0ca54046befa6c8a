"""`shardkit train --data-service URL` (issue 43, item 4): a torchrun job of 2 ranks reads its batches from a
`shardkit serve` service while one of its 2 worker processes is SIGKILLed; every step trains on the samples the
in-process loader gives it."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from shardkit.loaders import StreamingDataLoader, StreamingDataset
from shardkit.serve.data import DataSpec
from shardkit.serve.local import LocalService
from train_runs import check_ok, sample_ids, torchrun, write_byte_dataset

pytestmark = pytest.mark.slow

STEPS, BATCH = 12, 6


def kill_one_worker(service: LocalService, started: float, killed: list) -> None:
    """SIGKILL the first worker seen with a stream open (or, after 60 s, any worker)."""
    while time.monotonic() - started < 60:
        busy = [w for w in service.workers() if w["load"].get("streams")]
        if busy:
            break
        time.sleep(0.05)
    victim = (busy or service.workers())[0]
    os.kill(victim["pid"], signal.SIGKILL)
    killed.append(victim)


def test_a_torchrun_job_trains_through_the_service_while_a_worker_is_killed(tmp_path):
    data = str(tmp_path / "data")
    write_byte_dataset(data, num_samples=480, seq_len=128)
    spec = DataSpec(source=data, options={"cache_dir": str(tmp_path / "service-cache")})
    with LocalService(spec, workers=2) as service:
        service.wait_for_workers(2)
        killed: list = []
        killer = threading.Thread(target=kill_one_worker, args=(service, time.monotonic(), killed))
        killer.start()
        result = check_ok(torchrun(tmp_path / "run", data, nproc=2, batch_size=BATCH, steps=STEPS,
                                   checkpoint_every=100, extra=("--data-service", service.url), timeout=240))
        killer.join()
        routes = service.dispatcher.routes
    assert routes >= 2, "the ranks did not read through the service"
    assert killed, "no worker was killed"
    want = {}
    loaders = [StreamingDataLoader(StreamingDataset(data, rank=r, world_size=2, cache_dir=str(tmp_path / "c")),
                                   batch_size=BATCH) for r in range(2)]
    for step, batches in enumerate(zip(*loaders), start=1):
        if step > STEPS:
            break
        want[step] = sorted(np.concatenate([b["sample_id"].numpy() for b in batches]).tolist())
    assert sample_ids(tmp_path / "run") == want
    print("reassigned streams:", result.stderr.count("resuming on another worker"))
