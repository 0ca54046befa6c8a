"""shardkit.integrations.batches: the token dtype of batches handed to frameworks (issue 24 item 2) and the
causal-LM fields the adapters build."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from integration_procs import dataset_url  # noqa: F401 - a fixture: the module's dataset
from loader_helpers import ids_from_tokens
from shardkit import StreamingDataLoader, StreamingDataset
from shardkit.integrations.batches import TypedBatches, causal_lm_fields, torch_token_dtype


def loader(url, tmp_path):
    dataset = StreamingDataset(url, cache_dir=str(tmp_path / "cache"), shuffle_window=50, rank=0, world_size=1)
    return StreamingDataLoader(dataset, batch_size=4)


@pytest.fixture
def gloo(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("name", ["int32", "int64"])
def test_typed_batches_cross_gloo_collectives_that_compact_tokens_cannot(dataset_url, tmp_path, gloo, name):
    raw = next(iter(loader(dataset_url, tmp_path)))
    assert raw["tokens"].dtype == torch.uint16  # the stored dtype of a vocabulary under 65,536
    with pytest.raises(RuntimeError, match="Invalid scalar type"):
        dist.broadcast(raw["tokens"], src=0)  # what accelerate's dispatch_batches does with every batch
    typed = next(iter(TypedBatches(loader(dataset_url, tmp_path), token_dtype=name)))
    assert typed["tokens"].dtype == torch_token_dtype(name)
    dist.broadcast(typed["tokens"], src=0)
    assert torch.equal(typed["tokens"].to(torch.int64), raw["tokens"].to(torch.int64))
    assert torch.equal(typed["sample_id"], raw["sample_id"])


def test_typed_batches_pass_state_and_length_through(dataset_url, tmp_path):
    whole = [b["sample_id"].tolist() for b in TypedBatches(loader(dataset_url, tmp_path))]
    first = TypedBatches(loader(dataset_url, tmp_path))
    assert len(first) == len(whole) == 15
    head = [b["sample_id"].tolist() for b in itertools.islice(first, 6)]
    resumed = TypedBatches(loader(dataset_url, tmp_path))
    resumed.load_state_dict(first.state_dict())
    assert head + [b["sample_id"].tolist() for b in resumed] == whole


def test_causal_lm_fields_are_inputs_and_next_tokens(dataset_url, tmp_path):
    batch = next(iter(loader(dataset_url, tmp_path)))
    inputs, labels = causal_lm_fields(batch)
    assert inputs.dtype == labels.dtype == torch.int64 and inputs.shape == labels.shape == (4, 16)
    assert torch.equal(inputs, batch["tokens"][:, :-1].long()) and torch.equal(labels, batch["tokens"][:, 1:].long())
    assert ids_from_tokens(inputs).tolist() == batch["sample_id"].tolist()


def test_a_bad_dtype_is_refused_naming_the_option():
    with pytest.raises(ValueError, match="token_dtype must be one of"):
        torch_token_dtype("float32")
