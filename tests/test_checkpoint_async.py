"""Background checkpoint saves (`--async-save`): what is written is the state at the save, and a job killed
while saving in the background resumes exactly.

The first test slows the file writer down so that training certainly changes the parameters while the save
is in flight: a save that wrote the live tensors instead of a staged copy would hold the later values. The
second runs the trainer under torchrun (2 ranks, DDP, gloo) with background saves, kills every rank before
step 7 (the save of step 6 may be in flight, or written and not yet marked complete), resumes, and asks for
the losses and sample ids of an uninterrupted run that saved synchronously.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from shardkit.train.checkpoint import Checkpointer, find_latest
from test_checkpoint import make_state, save, train_steps
from train_runs import check_ok, checkpoints, losses, sample_ids, torchrun, write_byte_dataset


def test_a_background_save_holds_the_state_of_its_step_while_training_goes_on(tmp_path, monkeypatch):
    write_data = FileSystemWriter.write_data

    def slow_write_data(self, plan, planner):
        time.sleep(0.5)  # the training below runs meanwhile
        return write_data(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", slow_write_data)
    model, optimizer, scheduler = make_state(0)
    train_steps(model, optimizer, scheduler, 2)
    at_save = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    checkpointer = Checkpointer(tmp_path, rank=0, async_save=True)
    save(checkpointer, 2, model, optimizer, scheduler)
    assert checkpointer.saving_in_background
    train_steps(model, optimizer, scheduler, 2)  # in place, while the save is being written
    assert not checkpointer.background_written()
    checkpointer.wait()
    assert find_latest(tmp_path).name == "step_00000002"

    fresh_model, fresh_optimizer, fresh_scheduler = make_state(1)
    loaded = checkpointer.load(find_latest(tmp_path), model=fresh_model, optimizer=fresh_optimizer,
                               scheduler=fresh_scheduler, world_size=1)
    assert loaded.step == 2 and loaded.rank_state["loader"] == {"consumed": 8}
    saved_model, saved_optimizer = at_save
    for name, tensor in fresh_model.state_dict().items():
        assert torch.equal(tensor, saved_model[name]), name
    later = model.state_dict()
    assert any(not torch.equal(later[name], saved_model[name]) for name in later)  # training did move on
    for index, state in fresh_optimizer.state_dict()["state"].items():
        assert torch.equal(state["exp_avg"], saved_optimizer["state"][index]["exp_avg"]), index


@pytest.mark.slow
def test_a_job_killed_while_saving_in_the_background_resumes_exactly(tmp_path):
    data = str(tmp_path / "bytes")
    write_byte_dataset(data)
    reference = tmp_path / "reference" / "run"
    check_ok(torchrun(reference, data, checkpoint_every=2))  # synchronous saves, never interrupted

    run_dir = tmp_path / "async" / "run"
    killed = torchrun(run_dir, data, checkpoint_every=2, fault="step:7", extra=("--async-save",))
    assert killed.returncode != 0 and "kills itself at step 7" in killed.stderr, killed.stderr[-3000:]
    # Step 6's save was started after step 6 and is marked complete at the next sync point at the earliest.
    latest = find_latest(run_dir / "checkpoints")
    assert latest is not None and latest.name == "step_00000004", checkpoints(run_dir)
    resumed = check_ok(torchrun(run_dir, data, checkpoint_every=2, extra=("--async-save",)))
    assert f"resumed from {latest} at step {int(latest.name[5:])}" in resumed.stdout, resumed.stdout[-3000:]

    assert losses(run_dir) == losses(reference)  # bitwise: same world size, same order
    assert sample_ids(run_dir) == sample_ids(reference)
    assert checkpoints(run_dir) == checkpoints(reference)  # the final background save was completed
