"""accelerate without the Trainer (issue 24): the script of docs/INTEGRATIONS.md run as it stands
(tests/recipe_runs.py; tests/test_doc_recipes.py runs it too, against shardkit's own loader), a new process per run
(torchrun for 2 ranks, gloo), resumed with `load_state` from the folder `save_state` wrote; and
`accelerator.prepare()` of shardkit's loader refused, since it would rebuild it."""

from __future__ import annotations

import pytest

import integration_procs as procs
from integration_procs import dataset_url  # noqa: F401 - a fixture: the module's dataset

pytest.importorskip("accelerate")
RECIPE = ("--recipe", "accelerate")  # the document's script (tests/recipe_runs.py)


@pytest.mark.parametrize("options", [dict(dispatch_batches=None), dict(dispatch_batches=False),
                                     dict(dispatch_batches=False, use_stateful_dataloader=True)],
                         ids=["dispatch-default", "no-dispatch", "stateful"])
def test_preparing_the_loader_is_refused(dataset_url, tmp_path, options):
    """prepare() rebuilds a DataLoader of accelerate's around the loader's dataset: the loader's batching and state
    would be gone (and on several processes rank 0's share broadcast, or every other batch of each share kept)."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    from shardkit import StreamingDataLoader, StreamingDataset
    from shardkit.integrations.accelerate import checkpoint_loader

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**options))
    loader = StreamingDataLoader(StreamingDataset(dataset_url, cache_dir=str(tmp_path / "cache")), batch_size=4)
    with pytest.raises(ValueError, match="belongs to a StreamingDataLoader.*checkpoint_loader"):
        next(iter(accelerator.prepare(loader)))  # the stateful one refuses in prepare() already
    with pytest.raises(TypeError, match="not pass it to accelerator.prepare"):
        checkpoint_loader(accelerator, accelerator.prepare(torch.utils.data.DataLoader(range(8), batch_size=4)))
    assert next(iter(loader))["tokens"].shape == (4, 17)  # the loader itself reads


def test_accelerate_running_this_process_alone_while_the_loader_splits_the_data_is_refused(dataset_url, tmp_path):
    """torchrun on a machine without GPUs, without accelerate's CPU setting: accelerate runs each process on its own
    while the loader splits the data by torchrun's WORLD_SIZE. (One process, the dataset told it is rank 0 of 2: what
    it reads from torchrun's environment.)"""
    from accelerate import Accelerator

    from shardkit import StreamingDataLoader, StreamingDataset
    from shardkit.integrations.accelerate import checkpoint_loader

    dataset = StreamingDataset(dataset_url, cache_dir=str(tmp_path / "cache"), rank=0, world_size=2)
    with pytest.raises(ValueError, match="^accelerate trains this process on its own, but the dataset splits the data "
                                         "over 2 ranks .* ACCELERATE_USE_CPU=true under torchrun"):
        checkpoint_loader(Accelerator(cpu=True), StreamingDataLoader(dataset, batch_size=4))


def test_a_prepared_dataloader_around_a_rank_aware_dataset_is_refused(dataset_url, tmp_path):
    """accelerate's default for an IterableDataset (dispatch_batches) lets rank 0 read and broadcast its batches:
    on two ranks, rank 1's share would never be read. (Run on one process with the dataset told it is rank 0 of 2:
    the wrapper is the same.)"""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from shardkit import StreamingDataset

    dataset = StreamingDataset(dataset_url, cache_dir=str(tmp_path / "cache"), rank=0, world_size=2, batch_size=2)
    prepared = Accelerator(cpu=True).prepare(DataLoader(dataset, batch_size=None))
    with pytest.raises(ValueError, match="DataLoaderDispatcher shards it again"):
        next(iter(prepared))


@pytest.mark.slow
def test_two_ranks_disjoint_complete_and_resumed_on_two_and_on_one(dataset_url, tmp_path):
    """The recipe on 2 ranks stopped after step 10 and resumed on 2 ranks and on 1, each run a new process: every
    step trains on what shardkit's own StreamingDataLoader reads at that step (computed here, in this process, as
    tests/test_doc_recipes.py does: the reference an uninterrupted framework run had to match, without starting
    one). The stopped run is also the document's two-process launch (test_doc_recipes leaves it to this test)."""
    head, tail = procs.stopped_and_resumed("recipe_runs.py", dataset_url, tmp_path, *RECIPE, steps=14, ranks=2)
    whole = procs.own_loader_steps(dataset_url, str(tmp_path / "own-cache"), steps=14, ranks=2)
    assert {rank: steps[:10] for rank, steps in whole.items()} == head  # the documented launch reads its shares
    procs.check_two_rank_epochs(whole)
    procs.check_resumed(whole, head, tail)
    # 2 -> 1 processes from the same checkpoint (the loader's state is global).
    assert (tmp_path / "cut" / "run" / "step-10" / "shardkit_loader.json").is_file()
    one = procs.run_script("recipe_runs.py", dataset_url, tmp_path / "cut", "one", *RECIPE, "--steps", 25, "--resume",
                           10)
    whole_one = procs.own_loader_steps(dataset_url, str(tmp_path / "own-cache"), steps=36)
    procs.check_elastic(head, one[0], whole_one[0])


def test_accelerates_set_epoch_after_a_load_keeps_the_loaded_position(dataset_url, tmp_path):
    """accelerate's prepared DataLoader passes set_epoch(epoch) on to the dataset, which a loop calls after resuming:
    the epoch the loaded state stands in goes on from the loaded position; another epoch starts at its beginning."""
    import itertools

    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader

    from shardkit import StreamingDataset

    def dataset():
        return StreamingDataset(dataset_url, cache_dir=str(tmp_path / "cache"), shuffle_window=50, batch_size=4,
                                rank=0, world_size=1)

    def ids(batches):
        return [i for batch in batches for i in batch["sample_id"].tolist()]

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=False))
    reference = dataset()
    epochs = [ids(DataLoader(reference, batch_size=None)) for _ in range(2)]
    first = dataset()
    head = ids(itertools.islice(DataLoader(first, batch_size=None), 6))
    assert head == epochs[0][:24]
    for epoch, expected in ((0, epochs[0][24:]), (1, epochs[1])):
        resumed = dataset()
        resumed.load_state_dict(first.state_dict())
        prepared = accelerator.prepare(DataLoader(resumed, batch_size=None))
        prepared.set_epoch(epoch)
        assert ids(prepared) == expected


def test_a_raw_text_loader_is_checkpointed_by_save_state_and_resumed_by_load_state(tmp_path):
    """checkpoint_loader takes a raw-text loader (a `StreamingDataLoader` for its check): `save_state` writes the
    lanes' cursors, `load_state` puts a fresh loader where the first one stood (one process)."""
    import itertools

    from accelerate import Accelerator

    from shardkit import StreamingDataLoader, StreamingDataset
    from shardkit.integrations.accelerate import checkpoint_loader
    from test_build import write_corpus

    corpus = write_corpus(tmp_path / "corpus", docs=40)

    def loader():
        return StreamingDataLoader(StreamingDataset([f"{corpus}/*.jsonl*"], tokenizer="byte", seq_len=16, lanes=3,
                                                    rank=0, world_size=1), batch_size=2)

    def ids(batches):
        return [b["sample_id"].tolist() for b in batches]

    whole = ids(itertools.islice(loader(), 5))
    first = Accelerator(cpu=True)
    cut = loader()
    checkpoint_loader(first, cut)
    assert ids(itertools.islice(cut, 2)) == whole[:2]
    first.save_state(str(tmp_path / "state"))
    second = Accelerator(cpu=True)
    resumed = loader()
    checkpoint_loader(second, resumed)
    second.load_state(str(tmp_path / "state"))
    assert ids(itertools.islice(resumed, 3)) == whole[2:]
