"""`shardkit serve` (issue 43): real Flight servers (dispatcher and workers), real consumers.

What every rank receives through the service is what the in-process loader gives it, step by step, for built
data, raw text and a raw mixture, with 1 and 3 workers, and after resumes (the resume contract of
`tests/resume_contract.py` run over served loaders: same ranks, and 2 -> 3 ranks). Worker threads serve these
(the same `WorkerServer` a worker process runs); `test_serve_faults.py` kills worker processes.
"""

from __future__ import annotations

import numpy as np
import pytest

from loader_helpers import write_fixed
from resume_contract import batch_ids, check_elastic_resume, check_resume, save, take
from shardkit.loaders import StreamingDataLoader, StreamingDataset
from shardkit.loaders.order.mixing import Stream
from shardkit.serve.data import DataSpec
from shardkit.serve.local import LocalService
from test_build import write_corpus

RAW = dict(tokenizer="byte", seq_len=128, unit_bytes=2048, lanes=7)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    write_fixed(str(root / "built"), 300, per_shard=40)
    write_corpus(root / "a", docs=60)
    write_corpus(root / "b", docs=40, seed=1)
    return root


def spec_of(data, kind: str) -> DataSpec:
    if kind == "built":
        return DataSpec(source=str(data / "built"), options={"cache_dir": str(data / "cache")})
    if kind == "raw":
        return DataSpec(source=str(data / "a"), options=RAW)
    return DataSpec(source=[{"url": str(data / "a"), "weight": 2.0, "raw_text": True},
                            {"url": str(data / "b"), "weight": 1.0, "raw_text": True}], options=RAW)


def in_process(spec: DataSpec, batch_size: int = 4):
    def make_loader(rank, world_size):
        return StreamingDataLoader(StreamingDataset(spec.dataset_source(), rank=rank, world_size=world_size,
                                                    **spec.options), batch_size=batch_size)
    return make_loader


def served(url: str, batch_size: int = 4):
    def make_loader(rank, world_size):
        return StreamingDataLoader(StreamingDataset(None, service=url, rank=rank, world_size=world_size),
                                   batch_size=batch_size)
    return make_loader


@pytest.fixture(scope="module", params=["built", "raw", "mixture"])
def kind(request):
    return request.param


@pytest.mark.parametrize("workers", [1, 3])
def test_every_rank_gets_the_in_process_batches(data, kind, workers):
    spec = spec_of(data, kind)
    with LocalService(spec, workers=0, worker_threads=workers) as service:
        service.wait_for_workers(workers)
        steps = 12
        for rank in range(2):
            want = take(in_process(spec)(rank, 2), steps)
            loader = served(service.url)(rank, 2)
            got = take(loader, steps)
            assert len(got) == steps
            for step, (g, w) in enumerate(zip(got, want)):
                np.testing.assert_array_equal(g, w, err_msg=f"{kind}, rank {rank}, step {step}")
        # the streams went over the workers (each consumer's stream to the least loaded)
        assert len(service.workers()) == workers


def test_resume_through_the_service_follows_the_contract(data, kind):
    spec = spec_of(data, kind)
    with LocalService(spec, workers=0, worker_threads=3) as service:
        service.wait_for_workers(3)
        if kind == "built":
            check_resume(served(service.url), world_size=2, epochs=2)
        else:
            check_resume(served(service.url), world_size=2, steps=8)
        if kind == "raw":
            check_elastic_resume(served(service.url), before=2, after=3, steps=8)
        # The contract's elastic check reads the built order from the source (the service keeps it) and takes raw
        # ids for positions (a mixture's are not): the served run is compared with the in-process one instead,
        # rank by rank, step by step.
        steps = None if kind == "built" else 8
        got, want = (_elastic(make, before=2, after=3, head=10, steps=steps)
                     for make in (served(service.url), in_process(spec)))
        for rank, (g, w) in enumerate(zip(got, want)):
            assert len(g) == len(w) >= 8
            np.testing.assert_array_equal(np.concatenate(g), np.concatenate(w), err_msg=f"rank {rank}")


def test_a_state_saved_in_process_resumes_through_the_service_and_back(data):
    spec = spec_of(data, "raw")
    with LocalService(spec, workers=0, worker_threads=1) as service:
        service.wait_for_workers(1)
        ranks = [in_process(spec)(rank, 2) for rank in range(2)]
        for loader in ranks:
            take(loader, 3)
        state = save(ranks)
        want = [take(_loaded(in_process(spec)(rank, 3), state), 5) for rank in range(3)]
        through = [_loaded(served(service.url)(rank, 3), state) for rank in range(3)]
        got = [take(loader, 2) for loader in through]
        back = [take(_loaded(in_process(spec)(rank, 3), save(through)), 3) for rank in range(3)]
        for rank in range(3):
            np.testing.assert_array_equal(np.concatenate(got[rank] + back[rank]), np.concatenate(want[rank]))


def _elastic(make_loader, *, before, after, head, steps=None):
    """Each of `after` ranks' batches for the rest of the epoch (or `steps` batches), resumed from `before` ranks
    after `head` steps."""
    first = [make_loader(rank, before) for rank in range(before)]
    for loader in first:
        take(loader, head)
    state = save(first)
    resumed = [_loaded(make_loader(rank, after), state) for rank in range(after)]
    return [[batch_ids(b) for b in loader] if steps is None else take(loader, steps) for loader in resumed]


def _loaded(loader, state):
    loader.load_state_dict(state)
    return loader


def test_the_consumer_tells_what_it_reads(data):
    spec = spec_of(data, "built")
    with LocalService(spec, workers=0, worker_threads=1) as service:
        service.wait_for_workers(1)
        dataset = StreamingDataset(None, service=service.url, rank=0, world_size=1)
        here = StreamingDataset(str(data / "built"), cache_dir=str(data / "cache"))
        assert dataset.identity() == here.identity()
        assert dataset.stream_identities() == here.stream_identities()
        assert dataset.source.shapes()[0][1].seq_len == 16
        loader = StreamingDataLoader(dataset, batch_size=4)
        assert len(loader) == len(StreamingDataLoader(here, batch_size=4)) == 75
        assert take(loader, 2)[0].shape == (4,)


def test_workers_of_another_machine_join_a_dispatcher(data):
    spec = spec_of(data, "built")
    with LocalService(spec, workers=0) as head, \
            LocalService(spec, workers=0, worker_threads=2, join=head.url) as joined:
        assert joined.url == head.url and joined.dispatcher is None
        head.wait_for_workers(2)
        got = take(served(head.url)(1, 2), 5)
        np.testing.assert_array_equal(np.concatenate(got), np.concatenate(take(in_process(spec)(1, 2), 5)))
