"""StreamingDataset iterated by loaders it does not control (issue 23 item 5): torchdata's StatefulDataLoader
and torch's DataLoader build their own iterators around it, and resume through its state_dict()."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader

from loader_helpers import write_fixed
from shardkit import StreamingDataset

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader


@pytest.fixture(scope="module")
def dataset_url(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("ds") / "data")
    write_fixed(url, 300, seq_len=16, per_shard=40)
    return url


def make(url, tmp_path):
    return StreamingDataset(url, cache_dir=str(tmp_path / "cache"), batch_size=4, shuffle_window=50, rank=0,
                            world_size=1)


def ids(batches) -> list[int]:
    return [int(i) for b in batches for i in b["sample_id"]]


def test_a_thrown_away_iterator_never_advances_the_epoch(dataset_url, tmp_path):
    ds = make(dataset_url, tmp_path)
    for _ in range(3):
        iter(ds)  # created, never read
    first = ids(ds)
    again = make(dataset_url, tmp_path)
    assert ids(again) == first  # epoch 0 both times
    assert ids(again) != first  # a finished epoch does advance


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_exactly_with_state_dict_called_before_load(dataset_url, tmp_path, workers):
    """What distributed checkpointing does: state_dict() of the fresh loader, then load_state_dict(saved)."""
    kwargs = dict(batch_size=None, num_workers=workers)
    reference = StatefulDataLoader(make(dataset_url, tmp_path), **kwargs)
    whole = ids(reference) + ids(reference)  # two epochs (with workers, both epoch 0: see docs/LOADING.md)
    assert (whole[:len(whole) // 2] != whole[len(whole) // 2:]) == (workers == 0)
    loader = StatefulDataLoader(make(dataset_url, tmp_path), **kwargs)
    head = ids(itertools.islice(loader, 0, None)) + ids(itertools.islice(loader, 30))  # epoch 0, 30 of epoch 1
    saved = loader.state_dict()
    resumed = StatefulDataLoader(make(dataset_url, tmp_path), **kwargs)
    resumed.state_dict()  # before loading: must not move the fresh dataset on
    resumed.load_state_dict(saved)
    assert head + ids(resumed) == whole
    assert len(set(whole[:len(whole) // 2])) == len(whole) // 2


def test_plain_dataloader_resumes_from_the_datasets_own_state(dataset_url, tmp_path):
    ds = make(dataset_url, tmp_path)
    whole = ids(DataLoader(make(dataset_url, tmp_path), batch_size=None))
    head = ids(itertools.islice(DataLoader(ds, batch_size=None), 20))
    state = ds.state_dict()
    assert state["position"] == {"epoch": 0, "samples": 20 * 4}
    fresh = make(dataset_url, tmp_path)
    fresh.load_state_dict(state)
    assert head + ids(DataLoader(fresh, batch_size=None)) == whole


def test_set_epoch_of_the_loaded_epoch_keeps_the_loaded_position(dataset_url, tmp_path):
    """accelerate (and loops written like DistributedSampler's) call set_epoch(epoch) after loading a state; the
    plain DataLoader loads at once, so that call must not send the dataset back to the start of its epoch."""
    reference = make(dataset_url, tmp_path)
    epochs = [ids(DataLoader(reference, batch_size=None)) for _ in range(3)]
    for epoch in (0, 1):
        ds = make(dataset_url, tmp_path)
        ds.set_epoch(epoch)
        head = ids(itertools.islice(DataLoader(ds, batch_size=None), 20))
        ds.set_epoch(epoch)  # the epoch it stands in: the rest of the broken-off iteration follows
        head += ids(itertools.islice(DataLoader(ds, batch_size=None), 5))
        resumed = make(dataset_url, tmp_path)
        resumed.load_state_dict(ds.state_dict())
        resumed.set_epoch(epoch)
        assert head + ids(DataLoader(resumed, batch_size=None)) == epochs[epoch]
        resumed.set_epoch(epoch + 1)  # the next epoch (after the rest of this one) comes whole
        assert ids(DataLoader(resumed, batch_size=None)) == epochs[epoch + 1]
    moved = make(dataset_url, tmp_path)
    moved.load_state_dict(ds.state_dict())  # stands in epoch 1, 25 batches in
    moved.set_epoch(0)  # another epoch: from its beginning
    assert ids(DataLoader(moved, batch_size=None)) == epochs[0]
    with pytest.raises(ValueError, match="set_epoch: epoch must be an integer >= 0, got -1"):
        moved.set_epoch(-1)
