"""transformers Trainer + accelerate through shardkit.integrations.huggingface (issue 24), with the real packages:
every run is a new process (torchrun for 2 ranks, gloo), the resumed run resumes the Trainer's own way
(`resume_from_checkpoint=True` picks the last checkpoint-N directory)."""

from __future__ import annotations

import re

import pytest

from integration_procs import (
    SAMPLES,
    check_resumed,
    check_two_rank_epochs,
    dataset_url,  # noqa: F401 - a fixture: the module's dataset
    ids_of,
    run_script,
)
from shardkit.loaders.state.envelope import decode

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def run(dataset_url, folder, name, *options, ranks=1, check=True):
    return run_script("hf_runs.py", dataset_url, folder, name, *options, ranks=ranks, check=check)


def test_only_a_fixed_length_streaming_dataset_is_taken(dataset_url, tmp_path):
    from torch.utils.data import DataLoader
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from loader_helpers import write_variable
    from shardkit import StreamingDataset
    from shardkit.integrations.huggingface import ShardkitTrainer

    model = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=32, n_embd=8, n_layer=1, n_head=2))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
    dataset = StreamingDataset(dataset_url, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(TypeError, match="train_dataset=StreamingDataset"):
        ShardkitTrainer(model=model, args=args, train_dataset=DataLoader(dataset, batch_size=None))
    url = str(tmp_path / "variable")
    write_variable(url, 20, max_len=10, per_shard=10)
    with pytest.raises(ValueError, match="variable length"):
        ShardkitTrainer(model=model, args=args, train_dataset=StreamingDataset(url, cache_dir=str(tmp_path / "c")))


def test_one_process_resume_with_gradient_accumulation_continues_with_the_same_samples(dataset_url, tmp_path):
    # 8 optimizer steps per epoch of 15 batches (the last one accumulates a single batch). Without accumulation:
    # the document's recipe (tests/test_doc_recipes.py).
    steps, stop = 10, 5
    options = ("--steps", steps, "--gas", 2)
    whole = run(dataset_url, tmp_path / "whole", "whole", *options)[0]
    stopped = run(dataset_url, tmp_path / "cut", "head", *options, "--stop-at", stop)[0]
    assert (tmp_path / "cut" / f"checkpoint-{stop}" / "shardkit_loader.json").is_file()
    resumed = run(dataset_url, tmp_path / "cut", "tail", *options, "--resume")[0]
    assert resumed[0][0] == stop  # the Trainer's steps count from 0: no replayed step, none missing
    assert stopped + resumed == whole  # crosses the end of epoch 0
    assert sorted(i for _, ids in whole[:15] for i in ids) == list(range(SAMPLES))


@pytest.mark.slow
def test_two_ranks_read_disjoint_complete_shares_and_resume_exactly_also_on_one(dataset_url, tmp_path):
    # accelerate's dispatch_batches=True (only rank 0 would read) and split_batches=True (8 per step, 4 per rank).
    whole = run(dataset_url, tmp_path / "whole", "whole", "--steps", 14, "--dispatch", 1, "--split", 1,
                "--batch", 8, ranks=2)
    check_two_rank_epochs(whole, steps=((0, 7), (7, 14)))  # the Trainer's steps count from 0
    # dispatch_batches=False (accelerate's IterableDatasetShard would keep every other batch).
    stopped = run(dataset_url, tmp_path / "cut", "head", "--steps", 14, "--stop-at", 10, "--dispatch", 0, ranks=2)
    resumed = run(dataset_url, tmp_path / "cut", "tail", "--steps", 14, "--resume", "--dispatch", 0, ranks=2)
    check_resumed(whole, stopped, resumed, first=10)

    # 2 -> 1 ranks with the same global batch (8 on one rank after 4 on each of two): accepted and exact.
    same_batch = run(dataset_url, tmp_path / "cut", "same-batch", "--steps", 14, "--resume", "checkpoint-10",
                     "--batch", 8)[0]
    assert same_batch[0][0] == 10
    epoch1 = ids_of(stopped[0], 7) + ids_of(stopped[1], 7) + ids_of(same_batch)
    assert sorted(epoch1) == sorted(ids_of(whole[0], 7) + ids_of(whole[1], 7))

    # 2 -> 1 ranks with another global batch: the Trainer's step counting refuses; with ignore_data_skip the loader
    # continues exactly.
    refused = run(dataset_url, tmp_path / "cut", "one", "--steps", 20, "--resume", "checkpoint-10",
                  check=False)
    assert refused.returncode != 0 and "ignore_data_skip=True" in refused.stderr, refused.stderr[-2000:]
    one = run(dataset_url, tmp_path / "cut", "one", "--steps", 20, "--resume", "checkpoint-10",
              "--ignore-data-skip")[0]
    # Epoch 1 began at step 7 on two ranks; 3 steps (24 samples) were read there, the rest (36) on one rank.
    epoch1 = ids_of(stopped[0], 7) + ids_of(stopped[1], 7) + ids_of(one)[:36]
    assert sorted(epoch1) == list(range(SAMPLES))


@pytest.mark.parametrize("split_batches", [False, True])
def test_accelerate_sharding_a_rank_aware_dataset_again_is_refused(dataset_url, tmp_path, split_batches):
    """A plain `Trainer(train_dataset=StreamingDataset)` on 2 ranks hands the rank-aware dataset to accelerate,
    whose IterableDatasetShard keeps every other batch of each rank's share (no error, half the data):
    shardkit refuses to be iterated under it and says what to use."""
    from accelerate.data_loader import IterableDatasetShard
    from torch.utils.data import DataLoader

    from shardkit import StreamingDataset

    dataset = StreamingDataset(dataset_url, cache_dir=str(tmp_path / "cache"), rank=0, world_size=2, batch_size=2)
    resharded = IterableDatasetShard(dataset, batch_size=4, num_processes=2, process_index=0,
                                     split_batches=split_batches)
    with pytest.raises(ValueError, match="IterableDatasetShard shards it again") as refused:
        next(iter(DataLoader(resharded, batch_size=None)))
    check_named_adapters_import(str(refused.value), "ShardkitTrainer")
    # The same dataset iterated directly (what shardkit's own integrations do) reads this rank's share.
    first = next(iter(DataLoader(dataset, batch_size=None)))
    assert first["tokens"].shape[0] == 2
    # One process: nothing is sharded twice, so accelerate's wrapper is harmless and allowed.
    alone = StreamingDataset(dataset_url, cache_dir=str(tmp_path / "cache"), rank=0, world_size=1, batch_size=2)
    assert next(iter(IterableDatasetShard(alone, batch_size=2, num_processes=1)))["tokens"].shape[0] == 2


def check_named_adapters_import(message: str, *names: str) -> None:
    """Every `shardkit.integrations...` name the message gives can be imported as written, and `names` are among
    them."""
    import importlib

    given = re.findall(r"shardkit\.integrations(?:\.\w+)+", message)
    assert {name.rpartition(".")[2] for name in given} >= set(names), message
    for name in given:
        module, _, attribute = name.rpartition(".")
        assert hasattr(importlib.import_module(module), attribute), name


def test_a_plain_trainer_is_told_the_batch_goes_to_the_dataset_or_to_use_shardkit_trainer(dataset_url, tmp_path):
    """A StreamingDataset without batch_size in a plain Trainer (one process): the refusal names the fixes that
    work (the dataset's batch_size with a DataLoader of batch_size=None, or ShardkitTrainer), importable as given."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from shardkit import StreamingDataset

    model = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=32, n_embd=8, n_layer=1, n_head=2))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=2,
                             per_device_train_batch_size=4, disable_tqdm=True)
    dataset = StreamingDataset(dataset_url, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"batch_size=B\) inside DataLoader\(dataset, batch_size=None\)") as refused:
        Trainer(model=model, args=args, train_dataset=dataset).train()
    check_named_adapters_import(str(refused.value), "ShardkitTrainer")


@pytest.mark.slow
def test_the_trainer_not_distributed_under_torchrun_is_refused(dataset_url, tmp_path):
    """torchrun on a machine without GPUs, without ACCELERATE_USE_CPU / use_cpu: accelerate runs each process on its
    own while shardkit splits the data by torchrun's WORLD_SIZE: each would train its own model on half the data."""
    refused = run(dataset_url, tmp_path, "refused", "--steps", 4, "--no-cpu-setting", ranks=2, check=False)
    assert refused.returncode != 0
    assert "transformers' Trainer trains this process on its own, but the dataset splits the data over 2 ranks" in \
        refused.stderr, refused.stderr[-3000:]
    assert "ACCELERATE_USE_CPU=true" in refused.stderr


def test_a_raw_text_dataset_trains_and_resumes_in_process(tmp_path):
    """ShardkitTrainer over raw text (tokenized and packed by the loader): the loader state goes into the
    Trainer's checkpoint, and a resumed Trainer continues with the samples of an uninterrupted run (one process)."""
    import json

    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from shardkit import StreamingDataset
    from shardkit.integrations.huggingface import ShardkitTrainer
    from test_build import write_corpus

    corpus = write_corpus(tmp_path / "corpus", docs=40)

    def train(output, steps, **resume):
        ids = []
        dataset = StreamingDataset([f"{corpus}/*.jsonl*"], tokenizer="byte", seq_len=16, lanes=3, rank=0,
                                   world_size=1)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=32, n_embd=8, n_layer=1, n_head=2))
        args = TrainingArguments(output_dir=str(output), use_cpu=True, report_to=[], max_steps=steps, save_steps=2,
                                 per_device_train_batch_size=2, logging_steps=100, seed=0)
        ShardkitTrainer(model=model, args=args, train_dataset=dataset,
                        on_sample_ids=lambda step, batch: ids.append([step, batch.tolist()])).train(**resume)
        return ids

    whole = train(tmp_path / "whole", 4)
    head = train(tmp_path / "cut", 2)
    saved = json.loads((tmp_path / "cut" / "checkpoint-2" / "shardkit_loader.json").read_text())
    assert saved["position"]["samples"] == 4 and decode(saved)["raw_text"]["cursors"]
    tail = train(tmp_path / "cut", 4, resume_from_checkpoint=True)
    assert head + tail == whole and [step for step, _ in whole] == [1, 2, 3, 4]
