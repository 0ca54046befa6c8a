"""Raw-text loaders through the resume contract every loader mode runs (`tests/resume_contract.py`, endless form):
exact resume at steps of the same ranks, and elastic resume 2 -> 3 and 4 -> 2 ranks, with 0 and 2 workers."""

from __future__ import annotations

import pytest

from resume_contract import check_elastic_resume, check_resume
from shardkit.loaders import StreamingDataLoader, StreamingDataset
from test_build import write_corpus

SETTINGS = dict(tokenizer="byte", seq_len=128, unit_bytes=2048, lanes=7)  # lanes that do not divide the batches


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("raw_resume") / "in", docs=80)


def factory(corpus, *, workers=0, pack="concat"):
    def make_loader(rank, world_size):
        dataset = StreamingDataset(str(corpus), **SETTINGS, pack=pack, rank=rank, world_size=world_size)
        return StreamingDataLoader(dataset, batch_size=3, num_workers=workers,
                                   multiprocessing_context="fork" if workers else None)
    return make_loader


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("world_size", [1, 2])
def test_exact_resume_at_every_save_point(corpus, world_size, workers):
    figures = check_resume(factory(corpus, workers=workers), world_size=world_size, steps=24)
    assert figures["steps"] == 24


@pytest.mark.parametrize("pack", ["bestfit", "none"])
def test_exact_resume_of_every_packing(corpus, pack):
    check_resume(factory(corpus, pack=pack), world_size=2, steps=16)


@pytest.mark.parametrize(("before", "after", "workers"), [(2, 3, 0), (4, 2, 0), (2, 3, 2), (4, 2, 2)])
def test_elastic_resume_continues_the_global_order(corpus, before, after, workers):
    check_elastic_resume(factory(corpus, workers=workers), before=before, after=after, steps=16)
