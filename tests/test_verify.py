"""shardkit.verify: what the hash cannot catch (a manifest that lies about the contents), and ordering."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from shardkit.formats import Sample, write_dataset
from shardkit.manifest import TokenizerInfo, write_manifest
from shardkit.storage import Storage
from shardkit.verify import ShardProblem, verify_dataset


def build(tmp_path, samples, **options):
    url = str(tmp_path / "ds")
    manifest = write_dataset(url, samples, tokenizer=TokenizerInfo(kind="byte", name="byte", vocab_size=1000),
                             **{"seq_len": None, "packing": "none", "max_samples": 2, **options})
    return Storage(url), manifest


def test_good_dataset_has_no_problems(tmp_path):
    storage, manifest = build(tmp_path, [np.arange(5)] * 5, shard_format="arrow")
    assert verify_dataset(storage, manifest, jobs=3) == []


def test_token_ids_beyond_the_vocabulary_are_reported(tmp_path):
    storage, manifest = build(tmp_path, [np.arange(5), np.arange(5), np.array([1, 999]), np.array([1, 2])])
    smaller = dataclasses.replace(manifest, tokenizer=TokenizerInfo(kind="byte", name="byte", vocab_size=500))
    write_manifest(storage, smaller)
    problems = verify_dataset(storage, smaller)
    assert [problem.shard for problem in problems] == ["shard-000001.tar"]
    assert "holds token id 999, outside the tokenizer's vocabulary of 500 ids" in problems[0].reason


def test_sample_lengths_must_match_seq_len(tmp_path):
    storage, manifest = build(tmp_path, [np.arange(9)] * 3 + [np.arange(8)], seq_len=8, packing="concat")
    assert verify_dataset(storage, manifest) == [
        ShardProblem("shard-000001.tar", "sample 1 holds 8 tokens; seq_len 8 with packing 'concat' needs 9")]


def test_variable_samples_must_respect_max_sample_tokens(tmp_path):
    storage, manifest = build(tmp_path, [np.arange(3), np.arange(12)])
    manifest = dataclasses.replace(manifest, max_sample_tokens=10)
    write_manifest(storage, manifest)
    assert verify_dataset(storage, manifest) == [
        ShardProblem("shard-000000.tar", "sample 1 holds 12 tokens, more than max_sample_tokens 10")]


def test_doc_source_must_name_an_input(tmp_path):
    samples = [Sample(np.arange(4), np.array([0]), np.array([s]), np.array([0])) for s in (0, 1, 0, 2)]
    storage, manifest = build(tmp_path, samples, sources=("a", "b"))
    assert verify_dataset(storage, manifest) == [
        ShardProblem("shard-000001.tar", "doc_source 2 names no input (the manifest lists 2 sources)")]


def test_problems_come_back_in_manifest_order_with_every_shard_reported(tmp_path):
    storage, manifest = build(tmp_path, [np.arange(4)] * 12)  # 6 shards
    for shard in manifest.shards[::2]:
        storage.delete(shard.name)
    seen = []
    problems = verify_dataset(storage, manifest, jobs=4, on_shard_checked=lambda s, r: seen.append((s.name, r is None)))
    assert [p.shard for p in problems] == [s.name for s in manifest.shards[::2]]
    assert all(p.reason.startswith("missing: ") for p in problems)
    assert sorted(seen) == sorted((s.name, i % 2 == 1) for i, s in enumerate(manifest.shards))
    with pytest.raises(ValueError, match="jobs must be >= 1"):
        verify_dataset(storage, manifest, jobs=0)
