"""One consumer's steps read in parts by several `shardkit serve` workers (issue 43: more workers cut one rank's
data wait). Raw text, and a mixture of a raw-text stream and a built one, split each step by lane (built rows by
shard); each worker reads its part of every step and the consumer assembles them: every batch (all its arrays)
and the state after it are the in-process loader's, step by step, on each rank. Worker threads serve these
(the `WorkerServer` a worker process runs); `test_serve_faults.py` kills a worker process while two read in parts.
"""

from __future__ import annotations

import json
from contextlib import closing

import numpy as np
import pytest
import torch

from shardkit.loaders import StreamingDataLoader, StreamingDataset
from shardkit.loaders.sources.service.parts import StepAssembly
from shardkit.serve.data import DataSpec
from shardkit.serve.local import LocalService
from test_build import WORDS, config, write_corpus

RAW = dict(tokenizer="byte", seq_len=128, unit_bytes=2048, lanes=7)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A raw corpus and a built dataset of the same tokenizer and seq_len (a mixture may hold both)."""
    from shardkit.tools.build import run_build

    root = tmp_path_factory.mktemp("serve_parts")
    write_corpus(root / "raw", docs=60)
    small = root / "small"
    small.mkdir()
    (small / "s.jsonl").write_text("".join(json.dumps({"text": f"built {i}: " + " ".join(WORDS[i:] * 9)}) + "\n"
                                           for i in range(12)))
    run_build(config([small], root / "built", seq_len=RAW["seq_len"]))
    return root


def spec_of(data, kind: str) -> DataSpec:
    if kind == "raw":
        return DataSpec(source=str(data / "raw"), options=RAW)
    return DataSpec(source=[{"url": str(data / "raw"), "weight": 0.7, "raw_text": True},
                            {"url": str(data / "built"), "weight": 0.3}],
                    options={**RAW, "cache_dir": str(data / "cache")})


@pytest.fixture
def service():
    """A service with `workers` worker threads, shut down (servers and heartbeats) however the test ends."""
    running: list[LocalService] = []

    def start(spec: DataSpec, workers: int = 3) -> LocalService:
        running.append(LocalService(spec, workers=0, worker_threads=workers))
        running[-1].wait_for_workers(workers)
        return running[-1]

    yield start
    for each in running:
        each.close()


@pytest.mark.parametrize("kind, workers", [("raw", 3), ("mixture", 3), ("mixture", 1)])
def test_steps_read_in_parts_are_the_in_process_batches_and_states(data, service, kind, workers):
    """Raw text and a mixture of a raw-text and a built stream, weighted: per step exactly the in-process batch
    and state, read in parts by 3 workers (and whole by 1)."""
    spec = spec_of(data, kind)
    running = service(spec, workers)
    for rank, world_size in [(0, 1), (1, 2)]:
        here = StreamingDataLoader(StreamingDataset(spec.dataset_source(), rank=rank, world_size=world_size,
                                                    **spec.options), batch_size=6)
        there = StreamingDataLoader(StreamingDataset(None, service=running.url, rank=rank, world_size=world_size),
                                    batch_size=6)
        with closing(iter(here)) as want, closing(iter(there)) as got:  # a failed test leaves no stream open
            for step in range(10):
                w, g = next(want), next(got)
                assert sorted(g) == sorted(w), f"{kind}, rank {rank}, step {step}"
                for name in w:
                    assert torch.equal(g[name], w[name]), f"{kind}, rank {rank}, step {step}: {name}"
                assert there.local_state_dict() == here.local_state_dict(), f"{kind}, rank {rank}, step {step}"
            if kind == "mixture":
                assert set(torch.cat([next(got)["stream"] for _ in range(4)]).tolist()) == {0, 1}
    # Each of the three workers read a part of the steps: not one worker per consumer.
    assert all(server.rows_sent > 0 for server, _ in running._threads), [s.rows_sent for s, _ in running._threads]


def test_a_resumed_consumer_reads_in_parts_from_its_state(data, service):
    spec = spec_of(data, "raw")
    running = service(spec)
    here = StreamingDataLoader(StreamingDataset(spec.dataset_source(), **spec.options), batch_size=4)
    steps = iter(here)
    for _ in range(5):
        next(steps)
    state = here.state_dict()
    want = [next(steps)["sample_id"] for _ in range(6)]
    there = StreamingDataLoader(StreamingDataset(None, service=running.url), batch_size=4)
    there.load_state_dict(state)
    with closing(iter(there)) as got:
        for step, ids in enumerate(want):
            assert torch.equal(next(got)["sample_id"], ids), f"step {step} after the resume"
        assert there.state_dict() == here.state_dict()


def test_parts_that_do_not_make_one_step_are_refused():
    assembly = StepAssembly(pad_id=0, token_dtype="uint16", output_dtype=None, variable=False, dense_segments=False)
    part = {"rows": np.array([0, 2]), "positions": np.array([5, 7]), "epochs": np.zeros(2, dtype=np.int64),
            "lengths": np.array([3, 3]), "tokens": np.arange(6, dtype=np.uint16), "doc_counts": np.array([1, 1]),
            "doc_starts": np.zeros(2, dtype=np.int64), "doc_source": np.zeros(2, dtype=np.int64)}
    with pytest.raises(ValueError, match=r"the parts of a step hold rows \[0, 2\], not each of 0..1 once"):
        assembly.batch([part])


def test_the_dispatcher_routes_a_consumer_to_several_distinct_workers(data, service):
    from shardkit.loaders.sources.service.client import ServiceClient

    running = service(spec_of(data, "raw"))
    client = ServiceClient(running.url, token=None, timeout=10)
    routes = client.route([], workers=8)
    assert len(routes) == len({worker for worker, _ in routes}) == 3
    assert {w for w, _ in client.route([routes[0][0]], workers=8)} == {w for w, _ in routes[1:]}
    with pytest.raises(ValueError, match="route request: workers must be an integer >= 1, got 0"):
        client.route([], workers=0)


def test_a_part_of_data_read_whole_or_outside_its_parts_is_refused_in_one_line(data, service):
    from shardkit.loaders.sources.service.client import ServiceClient
    from shardkit.loaders.sources.service.wire import StreamRequest

    fields = dict(rank=0, world_size=1, local_rank=0, local_world_size=1, batch_size=4, identity="x")
    with pytest.raises(ValueError, match=r"part 2 of 2\) is outside its world"):
        StreamRequest(**fields, part=2, parts=2)
    running = service(DataSpec(source=str(data / "built"), options={"cache_dir": str(data / "cache")}), 1)
    client = ServiceClient(running.url, token=None, timeout=10)
    (worker, location), = client.route([], workers=8)
    identity = client.action("describe", {})["identity"]
    with pytest.raises(ValueError, match=r"^data service: .* is not read in parts: ask for whole batches \(parts=1\)$"):
        client.open_stream(worker, location, StreamRequest(**{**fields, "identity": identity}, part=0, parts=2),
                           prefetch=4).close()
