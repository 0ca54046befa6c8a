"""torchtitan through shardkit.integrations.torchtitan (issue 24): its loader protocol (Config/build, `({"input":
LongTensor}, labels)` batches, empty-state load) and its CheckpointManager (DCP) on CPU, each run in a new
process; the resumed run loads the latest checkpoint the way torchtitan's Trainer does (one process: the document's
recipe, tests/test_doc_recipes.py)."""

from __future__ import annotations

import pytest
import torch

from integration_procs import (
    SAMPLES,
    check_resumed,
    check_two_rank_epochs,
    dataset_url,  # noqa: F401 - a fixture: the module's dataset
    ids_of,
    own_loader_steps,
    run_script,
    stopped_and_resumed,
)
from loader_helpers import ids_from_tokens

pytest.importorskip("torchtitan.components.checkpoint", reason="torchtitan is needed (see pyproject [integrations])")
from shardkit.integrations.torchtitan import STATE_KEY, ShardkitDataLoader  # noqa: E402


def build(url, tmp_path, *, rank=0, world=1, seq_len=16, **config):
    # The arguments torchtitan's Trainer passes to config.dataloader.build(...).
    if "raw_tokenizer" not in config:
        config.setdefault("cache_dir", str(tmp_path / "cache"))
    return ShardkitDataLoader.Config(dataset_path=url, **config).build(
        dp_world_size=world, dp_rank=rank, tokenizer=None, seq_len=seq_len, local_batch_size=4,
        snapshot_every_n_steps=None)


def test_batches_are_input_and_next_token_labels_and_an_empty_state_starts_fresh(dataset_url, tmp_path):
    loader = build(dataset_url, tmp_path)
    inputs, labels = next(iter(loader))
    assert list(inputs) == ["input"] and inputs["input"].dtype == labels.dtype == torch.int64
    assert inputs["input"].shape == labels.shape == (4, 16)
    assert torch.equal(inputs["input"][:, 1:], labels[:, :-1])
    fresh = build(dataset_url, tmp_path)
    fresh.load_state_dict({})  # what torchtitan loads into a run with no checkpoint
    first = build(dataset_url, tmp_path)
    assert torch.equal(next(iter(fresh))[0]["input"], next(iter(first))[0]["input"])
    with pytest.raises(ValueError, match=STATE_KEY):
        fresh.load_state_dict({"dp_rank_0": b"..."})  # torchtitan's own loader's state


def test_it_goes_on_into_the_next_epoch_like_torchtitans_loaders(dataset_url, tmp_path):
    batches = iter(build(dataset_url, tmp_path))
    ids = [ids_from_tokens(next(batches)[0]["input"]) for _ in range(30)]
    epochs = [sorted(int(i) for b in ids[e * 15:(e + 1) * 15] for i in b) for e in range(2)]
    assert epochs[0] == epochs[1] == list(range(SAMPLES))
    assert [b.tolist() for b in ids[:15]] != [b.tolist() for b in ids[15:]]  # reshuffled


def test_bad_configuration_is_named(dataset_url, tmp_path):
    with pytest.raises(ValueError, match="dataloader.dataset_path"):
        build("", tmp_path)
    with pytest.raises(ValueError, match="seq_len=32"):
        build(dataset_url, tmp_path, seq_len=32)


@pytest.mark.slow
def test_two_ranks_disjoint_complete_and_resumed_on_two_and_on_one(dataset_url, tmp_path):
    head, tail = stopped_and_resumed("titan_runs.py", dataset_url, tmp_path, steps=14, ranks=2)
    # The uninterrupted run: shardkit's own loader in this process (ShardkitDataLoader's defaults, 4 a batch), as
    # tests/test_doc_recipes.py checks the torchtitan recipe.
    whole = own_loader_steps(dataset_url, str(tmp_path / "own-cache"), steps=14, ranks=2)
    assert {rank: steps[:10] for rank, steps in whole.items()} == head
    check_two_rank_epochs(whole)
    check_resumed(whole, head, tail)
    # 2 -> 1 ranks from the same checkpoint (torchtitan's own loader refuses another data-parallel size):
    # epoch 1 began at step 8; 3 steps of it (24 samples) were read on two ranks, the other 36 on one.
    one = run_script("titan_runs.py", dataset_url, tmp_path / "cut", "one", "--steps", 20, "--resume", 10)[0]
    assert one[0][0] == 11
    assert sorted(ids_of(head[0], 8) + ids_of(head[1], 8) + ids_of(one)[:36]) == list(range(SAMPLES))


def test_raw_text_is_tokenized_by_the_loader_and_resumes_exactly(tmp_path):
    """With `raw_tokenizer` in the config, dataset_path names raw text: batches of seq_len inputs and labels without
    a build, and a loader built afresh that loads the saved state goes on with the very batches that followed."""
    from test_build import write_corpus

    corpus = write_corpus(tmp_path / "corpus", docs=60)
    raw = dict(raw_tokenizer="byte", pack="bestfit")
    whole = iter(build(f"{corpus}/*.jsonl", tmp_path, **raw))
    batches = [next(whole) for _ in range(6)]
    assert all(b[0]["input"].shape == b[1].shape == (4, 16) for b in batches)
    first = build(f"{corpus}/*.jsonl", tmp_path, **raw)
    head = iter(first)
    for _ in range(3):
        next(head)
    state = first.state_dict()
    resumed = build(f"{corpus}/*.jsonl", tmp_path, **raw)
    resumed.load_state_dict(state)
    tail = iter(resumed)
    for want in batches[3:]:
        inputs, labels = next(tail)
        assert torch.equal(inputs["input"], want[0]["input"]) and torch.equal(labels, want[1])
    with pytest.raises(ValueError, match='pack="none"'):
        build(f"{corpus}/*.jsonl", tmp_path, raw_tokenizer="byte", pack="none")


def test_raw_text_takes_unit_bytes_and_lanes_refuses_a_cache_dir_and_hooks_get_the_batch_number(tmp_path):
    """Issue 46 item 5: `unit_bytes` and `lanes` as in the Python API (the batches are those of
    StreamingDataset(..., unit_bytes=, lanes=)); `cache_dir` with raw text refused, not ignored; a dataset_path that
    is no dataset, and raw-text fields without raw_tokenizer, refused naming both kinds of input;
    `on_sample_ids(batch_number, ids)` numbered on across a resume."""
    import itertools

    from shardkit import StreamingDataLoader, StreamingDataset
    from test_build import write_corpus

    corpus = f"{write_corpus(tmp_path / 'corpus', docs=60)}/*.jsonl"
    sized = dict(raw_tokenizer="byte", unit_bytes=2048, lanes=2)
    own = StreamingDataLoader(StreamingDataset(corpus, tokenizer="byte", seq_len=16, unit_bytes=2048, lanes=2,
                                               rank=0, world_size=1), batch_size=4)
    default = next(iter(build(corpus, tmp_path, raw_tokenizer="byte")))[0]["input"]
    for (inputs, _), batch in zip(itertools.islice(build(corpus, tmp_path, **sized), 4), own):
        assert torch.equal(inputs["input"], batch["tokens"][:, :-1].long())
    assert not torch.equal(default, next(iter(build(corpus, tmp_path, **sized)))[0]["input"])
    with pytest.raises(ValueError, match="^dataloader.cache_dir='/nvme': raw text .* leave dataloader.cache_dir "
                                         "unset"):
        build(corpus, tmp_path, cache_dir="/nvme", **sized)
    with pytest.raises(ValueError, match=r"^dataloader.dataset_path='.*\*.jsonl' is no built shardkit dataset .*"
                                         "shardkit.json.*or raw text inputs .* with dataloader.raw_tokenizer"):
        build(corpus, tmp_path)
    with pytest.raises(ValueError, match="^dataloader.lanes: how raw text becomes samples, which needs "
                                         "dataloader.raw_tokenizer"):
        build(str(tmp_path / "data"), tmp_path, lanes=2)

    seen = []
    first = build(corpus, tmp_path, **sized)
    first.on_sample_ids = lambda number, ids: seen.append(number)
    list(itertools.islice(first, 3))
    resumed = build(corpus, tmp_path, **sized)
    resumed.load_state_dict(first.state_dict())
    resumed.on_sample_ids = lambda number, ids: seen.append(number)
    list(itertools.islice(resumed, 2))
    assert seen == [1, 2, 3, 4, 5]
