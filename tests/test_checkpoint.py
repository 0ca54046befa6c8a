"""Checkpointer in one process: round trip, completion marker, keep-K, async save, safe loading, RNG state."""

from __future__ import annotations

import pickle
import random
import time

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from shardkit.train import rng
from shardkit.train.checkpoint import Checkpointer, SafeLoadPlanner, find_latest, read_marker
from shardkit.train.config import ModelConfig, OptimizerConfig
from shardkit.train.model import Transformer
from shardkit.train.optim import build_optimizer, build_scheduler

CONFIG = ModelConfig(vocab_size=50, seq_len=8, n_layer=1, n_head=2, d_model=16)


def make_state(seed: int):
    torch.manual_seed(seed)
    model = Transformer(CONFIG)
    optimizer = build_optimizer(model, OptimizerConfig(warmup_steps=2))
    scheduler = build_scheduler(optimizer, OptimizerConfig(warmup_steps=2), total_steps=10)
    return model, optimizer, scheduler


def train_steps(model, optimizer, scheduler, steps: int):
    for _ in range(steps):
        tokens = torch.randint(0, 50, (2, 9))
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def save(checkpointer, step, model, optimizer, scheduler, **extra):
    checkpointer.save(step, model=model, optimizer=optimizer, scheduler=scheduler,
                      rank_state={"loader": {"consumed": step * 4}, **extra}, meta={"world_size": 1})


def test_round_trip_restores_model_optimizer_scheduler_and_rank_state(tmp_path):
    model, optimizer, scheduler = make_state(0)
    train_steps(model, optimizer, scheduler, 3)
    checkpointer = Checkpointer(tmp_path, rank=0)
    save(checkpointer, 3, model, optimizer, scheduler)
    fresh = make_state(1)
    loaded = checkpointer.load(find_latest(tmp_path), model=fresh[0], optimizer=fresh[1], scheduler=fresh[2],
                               world_size=1)
    assert (loaded.step, loaded.rank_state, loaded.same_topology) == (3, {"loader": {"consumed": 12}}, True)
    for a, b in zip(model.state_dict().values(), fresh[0].state_dict().values()):
        assert torch.equal(a, b)
    assert fresh[2].last_epoch == 3 and fresh[1].param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    # Training on from both gives identical weights: the optimizer moments came back too.
    torch.manual_seed(5)
    train_steps(model, optimizer, scheduler, 2)
    torch.manual_seed(5)
    train_steps(*fresh, 2)
    for a, b in zip(model.parameters(), fresh[0].parameters()):
        assert torch.equal(a, b)


def test_only_complete_checkpoints_count_and_the_newest_k_are_kept(tmp_path):
    model, optimizer, scheduler = make_state(0)
    checkpointer = Checkpointer(tmp_path, rank=0, keep=2)
    for step in (1, 2, 3):
        save(checkpointer, step, model, optimizer, scheduler)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000003"]
    # What a crash mid-save leaves behind: files without the completion marker, never picked up.
    (tmp_path / "step_00000004.partial").mkdir()
    (tmp_path / "step_00000004.partial" / "__0_0.distcp").write_bytes(b"half")
    assert find_latest(tmp_path).name == "step_00000003"
    with pytest.raises(ValueError, match="interrupted"):
        read_marker(tmp_path / "step_00000004.partial")
    save(checkpointer, 5, model, optimizer, scheduler)  # the next save clears the debris
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000005"]
    assert read_marker(tmp_path / "step_00000005")["step"] == 5


def test_async_save_completes_in_the_background(tmp_path):
    model, optimizer, scheduler = make_state(0)
    checkpointer = Checkpointer(tmp_path, rank=0, async_save=True)
    save(checkpointer, 1, model, optimizer, scheduler)
    assert checkpointer.saving_in_background and find_latest(tmp_path) is None  # not complete yet
    deadline = time.time() + 30
    while not checkpointer.background_written() and time.time() < deadline:
        time.sleep(0.05)
    checkpointer.wait()
    assert find_latest(tmp_path).name == "step_00000001"
    fresh = make_state(1)
    checkpointer.load(find_latest(tmp_path), model=fresh[0], optimizer=fresh[1], scheduler=fresh[2], world_size=1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh[0].parameters()))


class Payload:
    """Not an allow-listed type: unpickling it would run arbitrary code paths."""


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_loading_never_unpickles_arbitrary_objects(tmp_path):
    dcp.save({"evil": Payload(), "weights": torch.ones(2)}, checkpoint_id=str(tmp_path))
    unsafe = {"evil": None, "weights": torch.zeros(2)}
    dcp.load(unsafe, checkpoint_id=str(tmp_path))  # DCP's default planner unpickles anything
    assert isinstance(unsafe["evil"], Payload)
    with pytest.raises(CheckpointException) as info:
        dcp.load({"evil": None, "weights": torch.zeros(2)}, checkpoint_id=str(tmp_path), planner=SafeLoadPlanner())
    # failures: rank -> (exception, traceback)
    assert all(isinstance(failure[0], pickle.UnpicklingError) for failure in info.value.failures.values())


def test_rng_state_round_trip_is_plain_data():
    state = rng.get_state()
    import json
    state = json.loads(json.dumps(state))
    first = (torch.rand(3), np.random.rand(3), random.random())
    rng.set_state(state)
    second = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(first[0], second[0]) and np.array_equal(first[1], second[1]) and first[2] == second[2]


def test_saving_a_step_again_replaces_it(tmp_path):
    model, optimizer, scheduler = make_state(0)
    checkpointer = Checkpointer(tmp_path, rank=0)
    save(checkpointer, 2, model, optimizer, scheduler)
    (tmp_path / "step_00000002.old-notes").mkdir()  # names that are not checkpoints are ignored
    train_steps(model, optimizer, scheduler, 1)
    save(checkpointer, 2, model, optimizer, scheduler)  # e.g. a run restarted with --resume none
    fresh = make_state(1)
    checkpointer.load(find_latest(tmp_path), model=fresh[0], optimizer=fresh[1], scheduler=fresh[2], world_size=1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh[0].parameters()))
    assert find_latest(tmp_path).name == "step_00000002"
