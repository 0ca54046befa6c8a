"""The token dtype of batches handed to frameworks (the loader option token_dtype, issue 24 item 2) and the
causal-LM fields the adapters build (shardkit.integrations.batches)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from integration_procs import dataset_url  # noqa: F401 - a fixture: the module's dataset
from loader_helpers import ids_from_tokens
from shardkit import StreamingDataLoader, StreamingDataset
from shardkit.integrations.batches import causal_lm_fields


def loader(url, tmp_path, workers=0, **options):
    dataset = StreamingDataset(url, cache_dir=str(tmp_path / "cache"), shuffle_window=50, rank=0, world_size=1,
                               **options)
    return StreamingDataLoader(dataset, batch_size=4, num_workers=workers)


def standalone(url, tmp_path, workers=0, **options):
    dataset = StreamingDataset(url, cache_dir=str(tmp_path / "cache"), shuffle_window=50, rank=0, world_size=1,
                               batch_size=4, **options)
    return DataLoader(dataset, batch_size=None, num_workers=workers)


@pytest.fixture
def gloo(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("make, workers", [(loader, 0), (loader, 2), (standalone, 0)],
                         ids=["loader-0-workers", "loader-2-workers", "dataset-in-a-dataloader"])
@pytest.mark.parametrize("name", ["int32", "int64"])
def test_the_token_dtype_option_makes_batches_gloo_can_broadcast(dataset_url, tmp_path, gloo, name, make, workers):
    raw = list(make(dataset_url, tmp_path, workers))
    assert raw[0]["tokens"].dtype == torch.uint16  # the stored dtype of a vocabulary under 65,536
    with pytest.raises(RuntimeError, match="Invalid scalar type"):
        dist.broadcast(raw[0]["tokens"], src=0)  # what accelerate's dispatch_batches does with every batch
    typed = list(make(dataset_url, tmp_path, workers, token_dtype=name))
    assert len(typed) == len(raw) == 15
    for got, want in zip(typed, raw):
        assert got["tokens"].dtype == getattr(torch, name)
        dist.broadcast(got["tokens"], src=0)
        assert torch.equal(got["tokens"].to(torch.int64), want["tokens"].to(torch.int64))
        assert torch.equal(got["sample_id"], want["sample_id"])


def test_typed_batches_resume_like_compact_ones(dataset_url, tmp_path):
    whole = [b["sample_id"].tolist() for b in loader(dataset_url, tmp_path, token_dtype="int32")]
    first = loader(dataset_url, tmp_path, token_dtype="int32")
    head = [b["sample_id"].tolist() for b in itertools.islice(first, 6)]
    resumed = loader(dataset_url, tmp_path)  # not an order option: a state resumes with any token dtype
    resumed.load_state_dict(first.state_dict())
    assert head + [b["sample_id"].tolist() for b in resumed] == whole


def test_causal_lm_fields_are_inputs_and_next_tokens(dataset_url, tmp_path):
    batch = next(iter(loader(dataset_url, tmp_path)))
    inputs, labels = causal_lm_fields(batch)
    assert inputs.dtype == labels.dtype == torch.int64 and inputs.shape == labels.shape == (4, 16)
    assert torch.equal(inputs, batch["tokens"][:, :-1].long()) and torch.equal(labels, batch["tokens"][:, 1:].long())
    assert ids_from_tokens(inputs).tolist() == batch["sample_id"].tolist()


def test_a_bad_dtype_is_refused_naming_the_option(dataset_url, tmp_path):
    with pytest.raises(ValueError, match="^token_dtype must be None .* int32, int64, got 'float32'"):
        StreamingDataset(dataset_url, cache_dir=str(tmp_path / "cache"), token_dtype="float32")
