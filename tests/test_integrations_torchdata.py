"""StreamingDataset inside torchdata's StatefulDataLoader and torch's DataLoader (issue 24), in the loop a user writes
(tests/torchdata_runs.py): the state saved with torch.save and resumed in a new process, with 0 and 2 workers,
across an epoch end, on one and two ranks (gloo), and from two ranks to one (with 2 workers on one rank: the
document's recipe, tests/test_doc_recipes.py); and the mistakes refused (issue 35): the dataset's own state taken
while torch DataLoader workers iterate copies of it, a state loaded with another number of workers. In-process
save/load details: tests/test_standalone_resume.py."""

from __future__ import annotations

import pytest

from integration_procs import (
    SAMPLES,
    check_elastic,
    check_resumed,
    check_two_rank_epochs,
    dataset_url,  # noqa: F401 - a fixture: the module's dataset
    ids_of,
    own_loader_steps,
    run_script,
    stopped_and_resumed,
)

pytest.importorskip("torchdata.stateful_dataloader")


def own_loader(dataset_url, tmp_path, *, steps, ranks=1):
    """What torchdata_runs.py must read at each step without workers (4 a batch, shuffle window 50): shardkit's own
    loader in this process, standing in for an uninterrupted run in a new one."""
    return own_loader_steps(dataset_url, str(tmp_path / "own-cache"), steps=steps, ranks=ranks, shuffle_window=50)


# With 2 workers: the document's recipe (tests/test_doc_recipes.py).
@pytest.mark.parametrize("options", [("--workers", 0), ("--plain",)],
                         ids=["stateful-0-workers", "dataloader-0-workers"])
def test_resume_in_a_new_process_continues_across_the_epoch_end(dataset_url, tmp_path, options):
    head, tail = stopped_and_resumed("torchdata_runs.py", dataset_url, tmp_path, *options, steps=20)
    whole = own_loader(dataset_url, tmp_path, steps=20)
    check_resumed(whole, head, tail)
    whole = whole[0]
    assert sorted(ids_of(whole, 1, 16)) == list(range(SAMPLES))
    assert ids_of(whole, 16) != ids_of(whole, 1, 6)  # epoch 1 is another order, not epoch 0 again


TWO_RANKS = {  # run options, whether the stopped run also resumes on 2 ranks
    "stateful-0-workers": (("--workers", 0), True),
    "dataloader-0-workers": (("--plain",), False),
    "stateful-2-workers": (("--workers", 2), True),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(TWO_RANKS))
def test_two_ranks_disjoint_complete_and_resumed_on_two_and_on_one(dataset_url, tmp_path, case):
    """One 2-rank run stopped after step 10 serves both resumes. On 2 ranks: every rank continues exactly. 2 -> 1
    ranks: a state without workers is global (the position in the epoch's global order), so one rank continues
    exactly; a worker's state counts that worker's steps only, and is refused on another world size."""
    options, on_two = TWO_RANKS[case]
    workers = options[-1] == 2
    if on_two:
        head, tail = stopped_and_resumed("torchdata_runs.py", dataset_url, tmp_path, *options, steps=14, ranks=2)
    else:
        head = run_script("torchdata_runs.py", dataset_url, tmp_path / "cut", "head", "--steps", 14, "--stop-at", 10,
                          *options, ranks=2)
    if workers:  # the workers take turns: the uninterrupted run in a new process is the reference
        whole = run_script("torchdata_runs.py", dataset_url, tmp_path / "whole", "whole", "--steps", 14, *options,
                           ranks=2)
    else:
        whole = own_loader(dataset_url, tmp_path, steps=14, ranks=2)
        assert {rank: steps[:10] for rank, steps in whole.items()} == head
    check_two_rank_epochs(whole)
    if on_two:
        check_resumed(whole, head, tail)
    if workers:
        refused = run_script("torchdata_runs.py", dataset_url, tmp_path / "cut", "one", "--steps", 25, "--resume", 10,
                             *options, check=False)
        assert refused.returncode != 0 and "do not convert to a global batch of 4" in refused.stderr, refused.stderr
        return
    one = run_script("torchdata_runs.py", dataset_url, tmp_path / "cut", "one", "--steps", 25, "--resume", 10,
                     *options)[0]
    check_two_rank_epochs(head, steps=((1, 8),))
    check_elastic(head, one, own_loader(dataset_url, tmp_path, steps=36)[0])


def dataset(url, tmp_path):
    from shardkit import StreamingDataset

    return StreamingDataset(url, cache_dir=str(tmp_path / "cache"), shuffle_window=50, batch_size=4, rank=0,
                            world_size=1)


def test_the_state_of_a_dataset_that_torch_dataloader_workers_iterate_is_refused(dataset_url, tmp_path):
    """The workers iterate copies: the training process's dataset never moves, and its state would say that
    nothing was read (a resume would train the epoch again)."""
    import itertools

    from torch.utils.data import DataLoader

    read = dataset(dataset_url, tmp_path)
    list(itertools.islice(DataLoader(read, batch_size=None, num_workers=2), 3))
    with pytest.raises(ValueError, match="^StreamingDataset.state_dict\\(\\) in the training process, but "
                                         "DataLoader workers iterate.*StreamingDataLoader.*StatefulDataLoader"):
        read.state_dict()
    alone = dataset(dataset_url, tmp_path)  # without workers the dataset itself moves: its state is right
    list(itertools.islice(DataLoader(alone, batch_size=None), 3))
    assert alone.state_dict()["position"]["samples"] == 12


@pytest.mark.parametrize("saved, resumed", [(2, 0), (0, 2), (2, 1)])
def test_a_state_resumed_with_another_number_of_workers_is_refused_on_load(dataset_url, tmp_path, saved, resumed):
    """torchdata itself fails only at the next iteration, on its own keys (an AssertionError about _num_yielded)."""
    import itertools

    from shardkit.integrations.torchdata import StatefulDataLoader

    loader = StatefulDataLoader(dataset(dataset_url, tmp_path), batch_size=None, num_workers=saved)
    list(itertools.islice(loader, 3))
    state = loader.state_dict()
    other = StatefulDataLoader(dataset(dataset_url, tmp_path), batch_size=None, num_workers=resumed)
    with pytest.raises(ValueError, match=f"^cannot resume: the loader state was saved by a StatefulDataLoader with "
                                         f"num_workers={saved}, this one has num_workers={resumed}"):
        other.load_state_dict(state)
    same = StatefulDataLoader(dataset(dataset_url, tmp_path), batch_size=None, num_workers=saved)
    same.load_state_dict(state)
    assert len(list(same)) == 12  # the rest of the 15-step epoch


def test_a_raw_text_dataset_resumes_through_its_loader_in_a_plain_loop_and_is_refused_by_torchdata(tmp_path):
    """A raw-text dataset is a `StreamingDataset` for the integrations' checks; its resume state (the lanes'
    cursors) is its loader's: a plain loop resumes exactly from it, torchdata's StatefulDataLoader is refused by
    name (it would resume by reading every consumed batch again)."""
    import itertools

    from shardkit import StreamingDataLoader, StreamingDataset
    from shardkit.integrations.torchdata import StatefulDataLoader
    from test_build import write_corpus

    corpus = write_corpus(tmp_path / "corpus", docs=40)

    def raw(**options):
        return StreamingDataset([f"{corpus}/*.jsonl*"], tokenizer="byte", seq_len=16, lanes=3, rank=0, world_size=1,
                                **options)

    def ids(batches):
        return [b["sample_id"].tolist() for b in batches]

    loader = StreamingDataLoader(raw(), batch_size=2)
    assert isinstance(loader.dataset, StreamingDataset) and isinstance(loader, StreamingDataLoader)
    whole = ids(itertools.islice(StreamingDataLoader(raw(), batch_size=2), 6))
    assert ids(itertools.islice(loader, 3)) == whole[:3]
    resumed = StreamingDataLoader(raw(), batch_size=2)
    resumed.load_state_dict(loader.state_dict())
    assert ids(itertools.islice(resumed, 3)) == whole[3:]

    # Issue 46 item 2: the document's torch/torchdata recipe on raw text is refused before its first batch, with
    # or without its set_epoch call, naming StreamingDataLoader (it would train until the first checkpoint).
    from torch.utils.data import DataLoader

    for kind, name in ((StatefulDataLoader, "torchdata's StatefulDataLoader"), (DataLoader, "torch's DataLoader")):
        dataset = raw(batch_size=2)
        with pytest.raises(ValueError, match="^a raw-text StreamingDataset keeps no resume state of its own: "
                                             "iterate StreamingDataLoader"):
            dataset.set_epoch(0)
        with pytest.raises(ValueError, match=f"^a raw-text StreamingDataset iterated by {name} "
                                             "keeps no resume state: .*StreamingDataLoader"):
            next(iter(kind(dataset, batch_size=None)))
        with pytest.raises(ValueError, match="keeps no resume state of its own: iterate StreamingDataLoader"):
            dataset.state_dict()
    # The dataset of a StreamingDataLoader, iterated by another loader around it (accelerator.prepare's way).
    with pytest.raises(ValueError, match=r"iterated by torch's DataLoader \(the dataset of a "
                                         "StreamingDataLoader"):
        next(iter(DataLoader(loader.dataset, batch_size=None)))


@pytest.mark.parametrize("data", ["raw", "token_budget"])
def test_torchdata_nodes_prefetching_resumes_where_its_consumer_stood(tmp_path, data):
    """Issue 46 item 1, the framework opposite to Lightning: torchdata.nodes' Prefetcher takes the loader's state
    right after each next() (in its thread, ahead of its consumer) and on restore skips the items it yielded since
    that snapshot. The loader's state counts every batch it handed out, so a Loader restored from a state saved
    after 5 steps (its prefetcher 3 batches ahead) yields the uninterrupted run's batches from step 6 on: none
    twice, none lost. Raw text and token-budget batches: the loaders without a length."""
    import itertools

    from torchdata.nodes import IterableWrapper, Loader, Prefetcher

    from loader_helpers import write_variable
    from shardkit import StreamingDataLoader, StreamingDataset
    from test_build import write_corpus

    if data == "raw":
        corpus = write_corpus(tmp_path / "corpus", docs=40)

        def loader():
            return StreamingDataLoader(StreamingDataset([f"{corpus}/*.jsonl*"], tokenizer="byte", seq_len=16,
                                                        lanes=3, rank=0, world_size=1), batch_size=2)
    else:
        write_variable(str(tmp_path / "variable"), 60, max_len=32, per_shard=20)

        def loader():
            return StreamingDataLoader(StreamingDataset(str(tmp_path / "variable"), max_tokens=128, rank=0,
                                                        world_size=1, cache_dir=str(tmp_path / "cache")))

    def nodes():
        return Loader(Prefetcher(IterableWrapper(loader()), prefetch_factor=3))

    def ids(batches):
        return [b["sample_id"].tolist() for b in batches]

    whole = ids(itertools.islice(nodes(), 12))
    assert len(whole) == (12 if data == "raw" else 9)  # torchdata's Loader ends with the token-budget epoch
    first = nodes()
    head = ids(itertools.islice(first, 5))
    state = first.state_dict()
    resumed = nodes()
    resumed.load_state_dict(state)
    assert head + ids(itertools.islice(resumed, 7)) == whole
