"""`DevicePrefetcher` on the CPU with prefetching forced on: the order of the batches and an exact resume
state although one batch is always drawn ahead (on CUDA it also copies on a side stream; same logic)."""

from __future__ import annotations

import functools

import pytest
import torch

from shardkit.loaders.dataloader import StreamingDataLoader
from shardkit.loaders.dataset import StreamingDataset
from shardkit.train.data import Epochs, to_batch
from shardkit.train.prefetch import DevicePrefetcher
from train_runs import write_byte_dataset

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("prefetch") / "data")
    write_byte_dataset(url, num_samples=40)  # 10 batches of 4 per epoch
    return url


def batches(data: str, tmp_path, *, ahead: bool, state=None) -> DevicePrefetcher:
    loader = StreamingDataLoader(StreamingDataset(data, cache_dir=str(tmp_path / "cache"), shuffle=True, seed=3),
                                 batch_size=4)
    prefetcher = DevicePrefetcher(Epochs(loader, allow_mixture_change=False), functools.partial(to_batch, device=CPU),
                                  CPU, ahead=ahead)
    if state is not None:
        prefetcher.load_state_dict(state)
    return prefetcher


def take(prefetcher: DevicePrefetcher, count: int) -> list[list[int]]:
    return [next(prefetcher).sample_ids for _ in range(count)]


def test_prefetching_keeps_the_order_across_epochs_and_is_off_on_cpu_by_default(data, tmp_path):
    assert not DevicePrefetcher(iter([]), lambda raw: raw, CPU).ahead  # CPU: a plain pass-through
    plain = take(batches(data, tmp_path, ahead=False), 25)
    assert take(batches(data, tmp_path, ahead=True), 25) == plain  # 2.5 epochs, the same batches in order


@pytest.mark.parametrize("taken", [1, 7, 10, 13])  # early, mid-epoch, at the epoch's end, in the next epoch
def test_the_saved_state_does_not_count_the_batch_drawn_ahead(data, tmp_path, taken):
    reference = take(batches(data, tmp_path, ahead=False), taken + 5)
    prefetcher = batches(data, tmp_path, ahead=True)
    assert take(prefetcher, taken) == reference[:taken]
    state = prefetcher.state_dict()
    # The loader itself has handed out one batch more (the prefetched one): its state would skip it.
    assert prefetcher.source.state_dict() != state
    assert take(batches(data, tmp_path, ahead=True, state=state), 5) == reference[taken:]
    # Loading a state into a prefetcher that holds a batch drawn under another state drops that batch.
    prefetcher.load_state_dict(state)
    assert take(prefetcher, 5) == reference[taken:]
