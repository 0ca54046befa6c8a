"""StreamingDataLoader in one process: batch contract, epochs, workers, state checks (the exact resume
contract of every loader mode is in test_dataloader_resume.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from loader_helpers import ids_from_tokens, write_fixed
from shardkit import StreamingDataLoader, StreamingDataset


@pytest.fixture(scope="module")
def dataset_url(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("ds") / "data")
    write_fixed(url, 500, seq_len=16, per_shard=48)
    return url


def make(url, tmp_path, **kwargs):
    kwargs.setdefault("shuffle_window", 60)
    return StreamingDataset(url, cache_dir=str(tmp_path / "cache"), **kwargs)


def run(loader, limit=None):
    """Batches of one pass; with `limit`, stop after receiving that many (islice pulls no extra)."""
    return list(itertools.islice(loader, limit))


def test_batch_contract(dataset_url, tmp_path):
    loader = StreamingDataLoader(make(dataset_url, tmp_path), batch_size=8)
    batches = run(loader)
    assert len(batches) == len(loader) == 500 // 8
    batch = batches[0]
    assert batch["tokens"].shape == (8, 17) and batch["tokens"].dtype == torch.uint16
    assert batch["sample_id"].dtype == torch.int64 and batch["cu_seqlens"].dtype == torch.int32
    assert "segment_ids" not in batch  # dense ids only on request (issue 23)
    # the tokens are those of the sample named by sample_id
    np.testing.assert_array_equal(ids_from_tokens(batch["tokens"]), batch["sample_id"].numpy())
    ids = torch.cat([b["sample_id"] for b in batches]).numpy()
    assert len(np.unique(ids)) == len(ids) == 496
    sid = batch["sample_id"].numpy()
    # fixed_sample puts its second document at 1 + i % 15: two segments per row, over the flattened batch
    expected = [offset for r, i in enumerate(sid) for offset in (17 * r, 17 * r + 1 + i % 15)] + [8 * 17]
    assert batch["cu_seqlens"].tolist() == expected and batch["padding_segments"].numel() == 0
    dense = run(StreamingDataLoader(make(dataset_url, tmp_path, segment_ids=True), batch_size=8), limit=1)[0]
    assert dense["segment_ids"].dtype == torch.int32 and torch.equal(dense["cu_seqlens"], batch["cu_seqlens"])
    seg = dense["segment_ids"].numpy()
    for row, i in zip(seg, sid):  # fixed_sample puts its second document at 1 + i % 15
        assert row[0] == 0 and row.max() == 1 and np.argmax(row) == 1 + i % 15
    assert batch["tokens"].long().max() < 60000


def test_epochs_reshuffle_and_persistent_workers_neither_shorten_nor_repeat(dataset_url, tmp_path):
    ds = make(dataset_url, tmp_path)
    plain = StreamingDataLoader(ds, batch_size=8)
    epochs = [torch.cat([b["sample_id"] for b in plain]) for _ in range(3)]
    assert plain.epoch == 3
    assert not torch.equal(epochs[0], epochs[1])
    for e in epochs:
        assert len(e) == 496 and len(torch.unique(e)) == 496
    persistent = StreamingDataLoader(ds, batch_size=8, num_workers=2, persistent_workers=True)
    for e in range(3):
        assert torch.equal(torch.cat([b["sample_id"] for b in persistent]), epochs[e])


def test_break_then_iterate_again_continues_the_same_epoch(dataset_url, tmp_path):
    ds = make(dataset_url, tmp_path)
    whole = torch.cat([b["sample_id"] for b in StreamingDataLoader(ds, batch_size=8)])
    loader = StreamingDataLoader(ds, batch_size=8, num_workers=2, persistent_workers=True)
    part = [b["sample_id"] for b in run(loader, limit=5)]
    rest = [b["sample_id"] for b in loader]
    assert torch.equal(torch.cat(part + rest), whole)
    assert loader.epoch == 1


def test_pad_policy_gives_full_batches(dataset_url, tmp_path):
    loader = StreamingDataLoader(make(dataset_url, tmp_path, partial_batches="pad"), batch_size=8)
    ids = torch.cat([b["sample_id"] for b in loader])
    assert len(ids) == 504 and len(torch.unique(ids)) == 500


def test_incompatible_state_is_refused_with_the_differences(dataset_url, tmp_path):
    loader = StreamingDataLoader(make(dataset_url, tmp_path, seed=1), batch_size=8)
    state = loader.state_dict()
    other = StreamingDataLoader(make(dataset_url, tmp_path, seed=2), batch_size=8)
    with pytest.raises(ValueError, match="seed: saved 1, now 2"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        loader.load_state_dict({**state, "version": 99})
    with pytest.raises(ValueError, match="kind"):
        loader.load_state_dict({"epoch": 0})


def test_standalone_dataset_iteration_needs_batch_size(dataset_url, tmp_path):
    ds = make(dataset_url, tmp_path)
    with pytest.raises(ValueError, match="batch_size"):
        next(iter(ds))
    ds = make(dataset_url, tmp_path, batch_size=10, rank=1, world_size=2)
    batches = list(ds)
    assert len(batches) == len(ds) == 25 and batches[0]["tokens"].shape == (10, 17)


def test_loader_state_format_and_validation(dataset_url, tmp_path):
    import dataclasses
    from dataclasses import FrozenInstanceError

    from shardkit.loaders.config import DEFAULT_TOKEN_WINDOW
    from shardkit.loaders.state.loader_state import LoaderState

    from shardkit.loaders.state.envelope import decode

    saved_state = StreamingDataLoader(make(dataset_url, tmp_path), batch_size=8).state_dict()
    assert saved_state["version"] == 2  # the saved format: a new version must be a deliberate change
    saved = LoaderState.from_dict(saved_state)
    assert saved.to_dict() == saved_state
    # the flat record (version 1, as the previous release wrote it) still loads, with the same checks
    state = decode(saved_state)
    assert state["version"] == 1 and LoaderState.from_dict(state) == dataclasses.replace(saved, legacy_identities=True)
    # optional fields absent (a fixed-length state of an earlier release) take their defaults
    old = {k: v for k, v in state.items() if k not in ("max_tokens", "token_window", "window_segments")}
    loaded = LoaderState.from_dict(old)
    assert (loaded.max_tokens, loaded.token_window, loaded.window_segments) == (None, DEFAULT_TOKEN_WINDOW, ())
    with pytest.raises(ValueError, match="lacks seed"):
        LoaderState.from_dict({k: v for k, v in state.items() if k != "seed"})
    for epoch, consumed in ((-1, 0), (0, -1)):
        with pytest.raises(ValueError, match=r"must be an integer in \[0, 2\*\*62\)"):
            LoaderState.from_dict({**state, "epoch": epoch, "samples_consumed": consumed})
        with pytest.raises(ValueError, match=r"position\.(epoch|samples) must be an integer"):
            LoaderState.from_dict({**saved_state, "position": {"epoch": epoch, "samples": consumed}})
    with pytest.raises(FrozenInstanceError):
        saved.epoch = 3
    with pytest.raises(TypeError):  # keyword-only: a positional call cannot swap two integers silently
        LoaderState(*[getattr(saved, f) for f in saved.__dataclass_fields__])
    # a single dataset's state carries no mixture key; a mixture's record survives the round trip
    assert "mixture" not in saved_state
    record = {"streams": [{"url": "a", "weight": 1.0, "identity": "x"}], "changes": []}
    mixed = LoaderState.from_dict({**saved_state, "mixture": record})
    assert mixed.to_dict()["mixture"] == record and LoaderState.from_dict(mixed.to_dict()) == mixed
    # quarantine entries: shard 0 of epoch 0 at position 0 is a valid entry; a negative one is not
    assert LoaderState.from_dict({**saved_state, "quarantine": [[0, 0, 0]]}).quarantine == ((0, 0, 0),)
    with pytest.raises(ValueError, match="quarantine entries must be >= 0"):
        LoaderState.from_dict({**saved_state, "quarantine": [[0, -1, 0]]})
