"""Loader batches -> trainer micro-batches: padding written by `--pack bestfit` is never a target."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shardkit import StreamingDataLoader, StreamingDataset
from shardkit.formats import Sample, write_dataset
from shardkit.loaders.config import LoaderConfig
from shardkit.manifest import TokenizerInfo
from shardkit.train.data import IGNORE_INDEX, to_batch

SEQ_LEN = 8
PAD = 0


def padded_sample(i: int) -> Sample:
    """A document of 4 + i % 4 tokens, then padding (segment source -1) up to SEQ_LEN + 1 tokens."""
    real = 4 + i % 4
    tokens = np.full(SEQ_LEN + 1, PAD, dtype=np.int64)
    tokens[:real] = 10 + (np.arange(real) + i) % 200
    return Sample(tokens, np.array([0, real]), np.array([0, -1]), np.array([i, 0]))


def test_padding_targets_are_ignored_and_not_counted(tmp_path):
    url = str(tmp_path / "ds")
    write_dataset(url, (padded_sample(i) for i in range(32)), seq_len=SEQ_LEN, packing="bestfit",
                  tokenizer=TokenizerInfo(kind="byte", name="byte", vocab_size=258, pad_id=PAD))
    dataset = StreamingDataset(url, cache_dir=str(tmp_path / "cache"), shuffle=False, rank=0, world_size=1,
                               local_rank=0, local_world_size=1)
    checked = 0
    for raw in StreamingDataLoader(dataset, batch_size=4):
        batch = to_batch(raw, torch.device("cpu"))
        for row, sample_id in enumerate(batch.sample_ids):
            real = 4 + sample_id % 4
            # Targets are tokens 1..SEQ_LEN; those at positions >= real are padding.
            expected = padded_sample(sample_id).tokens[1:].copy()
            expected[real - 1:] = IGNORE_INDEX
            assert batch.targets[row].tolist() == expected.tolist()
        assert batch.num_tokens == sum(4 + s % 4 - 1 for s in batch.sample_ids)
        # Whatever the logits say at padded positions, the loss is the mean over real targets only.
        logits = torch.randn(*batch.targets.shape, 258)
        real_only = batch.targets != IGNORE_INDEX
        loss = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten())
        manual = F.cross_entropy(logits[real_only], batch.targets[real_only])
        torch.testing.assert_close(loss, manual)
        checked += len(batch.sample_ids)
    assert checked == 32


def test_batches_without_padding_keep_every_target():
    tokens = torch.arange(18, dtype=torch.int64).reshape(2, 9)
    raw = {"tokens": tokens, "sample_id": torch.tensor([0, 1]), "segment_ids": torch.zeros(2, 9, dtype=torch.int32)}
    batch = to_batch(raw, torch.device("cpu"))
    assert torch.equal(batch.targets, tokens[:, 1:]) and batch.num_tokens == 16
    assert batch.segment_ids.shape == (2, 8)


def test_trainer_data_options_reach_the_loader_and_mix_streams(tmp_path):
    """`--data A:3 B:1` mixes both datasets 3:1 and every loader option arrives in the dataset."""
    from shardkit.train.config import DataConfig
    from shardkit.train.data import TrainStream
    from shardkit.train.parallel import Runtime
    from shardkit.train.parallel.mesh import ParallelDims

    tokenizer = TokenizerInfo(kind="byte", name="byte", vocab_size=258, pad_id=PAD)
    for name in ("a", "b"):
        write_dataset(str(tmp_path / name), (padded_sample(i) for i in range(64)), seq_len=SEQ_LEN,
                      packing="bestfit", tokenizer=tokenizer)
    config = DataConfig(data=f"{tmp_path / 'a'}:3,{tmp_path / 'b'}:1", batch_size=8,
                        cache_dir=str(tmp_path / "cache"),
                        loader=LoaderConfig(shuffle_window=16, cache_limit=10**7, seed=4, epoch_size=64))
    runtime = Runtime(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
                      dims=ParallelDims())
    stream = TrainStream(config, runtime)
    dataset = stream.loader.dataset
    assert dataset.config == config.loader and dataset.caches[0].cache_limit == 10**7
    ids = np.concatenate([next(stream).sample_ids for _ in range(8)])
    from_a = int((ids < 64).sum())
    assert (from_a, len(ids) - from_a) == (48, 16)


def test_trainer_fetches_each_manifest_once_and_checks_the_loaders_copy(tmp_path, monkeypatch):
    """The trainer's data (training and held-out set) fetch each manifest once per process, through the node cache
    (one hash per node), and its dataset checks read the loader's copy instead of fetching it again."""
    from shardkit import node_cache as cache_module
    from shardkit.train.config import DataConfig
    from shardkit.train.data import EvalData, TrainStream, check_dataset
    from shardkit.train.parallel import Runtime
    from shardkit.train.parallel.mesh import ParallelDims

    tokenizer = TokenizerInfo(kind="byte", name="byte", vocab_size=258, pad_id=PAD)
    url = str(tmp_path / "a")
    manifest = write_dataset(url, (padded_sample(i) for i in range(16)), seq_len=SEQ_LEN, packing="bestfit",
                             tokenizer=tokenizer)
    hashes, fetches = [], []  # the node's first process hashes the JSON as it loads it; every fetch loads it
    hash_and_load, load = cache_module.load_manifest_and_digest, cache_module.load_manifest
    monkeypatch.setattr(cache_module, "load_manifest_and_digest",
                        lambda *a, **k: hashes.append(1) or fetches.append(1) or hash_and_load(*a, **k))
    monkeypatch.setattr(cache_module, "load_manifest", lambda *a, **k: fetches.append(1) or load(*a, **k))
    runtime = Runtime(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"),
                      dims=ParallelDims())
    for mode in ("decoded", "none"):
        fetches.clear()
        config = DataConfig(data=url, eval_data=url, batch_size=4, cache_dir=str(tmp_path / mode),
                            loader=LoaderConfig(cache_mode=mode))
        train, held_out = TrainStream(config, runtime), EvalData(url, config, runtime)
        assert check_dataset(train.loader.dataset, seq_len=SEQ_LEN, what="--data") == manifest
        assert check_dataset(held_out.dataset, seq_len=SEQ_LEN, what="--eval-data") == manifest
        first = [b["sample_id"].tolist() for b in held_out.batches()]
        assert [b["sample_id"].tolist() for b in held_out.batches()] == first and first  # the same at each evaluation
        assert len(fetches) == 2, "a manifest was fetched again (once for the training data, once for the held-out)"
        records = list((tmp_path / mode).rglob("shardkit.json.record"))
        assert len(records) == (mode != "none")  # "none" keeps nothing on disk, not even the record
    assert len(hashes) == 1  # the first fetch hashed it for the node; the later ones trusted the node's record
    with pytest.raises(ValueError, match="--data .* has seq_len 8 but --seq-len is 9"):
        check_dataset(train.loader.dataset, seq_len=SEQ_LEN + 1, what="--data")
