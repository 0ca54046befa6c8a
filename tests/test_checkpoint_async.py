"""Background checkpoint saves (`--async-save`): what is written is the state at the save, and a job killed
while saving in the background resumes exactly.

The first test slows the file writer down so that training certainly changes the parameters while the save
is in flight: a save that wrote the live tensors instead of a staged copy would hold the later values. The
second runs the trainer under torchrun (2 ranks, DDP, gloo) with background saves, kills every rank before
step 7 (the save of step 6 may be in flight, or written and not yet marked complete), resumes, and asks for
the losses and sample ids of an uninterrupted run that saved synchronously. With a process group the saves
are written by DCP's writer process, which stays quiet; rank 0 marks a checkpoint complete in a thread, whose
failure the next wait raises.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from conftest import free_port
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
def test_a_job_killed_while_saving_in_the_background_resumes_exactly(tmp_path, monkeypatch):
    data = str(tmp_path / "bytes")
    write_byte_dataset(data)
    reference = tmp_path / "reference" / "run"
    check_ok(torchrun(reference, data, checkpoint_every=2))  # synchronous saves, never interrupted

    run_dir = tmp_path / "async" / "run"
    # Every save in the background: no save written synchronously while the writer process starts.
    monkeypatch.setenv("SHARDKIT_CHECKPOINT_WRITER_START", "wait")
    killed = torchrun(run_dir, data, checkpoint_every=2, fault="step:7", extra=("--async-save",))
    assert killed.returncode != 0 and "kills itself at step 7" in killed.stderr, killed.stderr[-3000:]
    # Step 6's save was started after step 6 and is marked complete at the next sync point at the earliest; step 4's,
    # written by then, is marked complete by rank 0's thread from step 6's sync point on (the kill may come first).
    latest = find_latest(run_dir / "checkpoints")
    assert latest is not None and latest.name in ("step_00000002", "step_00000004"), checkpoints(run_dir)
    monkeypatch.delenv("SHARDKIT_CHECKPOINT_WRITER_START")  # the resumed run saves synchronously until its writer is up
    resumed = check_ok(torchrun(run_dir, data, checkpoint_every=2, extra=("--async-save",)))
    assert f"resumed from {latest} at step {int(latest.name[5:])}" in resumed.stdout, resumed.stdout[-3000:]

    assert losses(run_dir) == losses(reference)  # bitwise: same world size, same order
    assert sample_ids(run_dir) == sample_ids(reference)
    assert checkpoints(run_dir) == checkpoints(reference)  # the final background save was completed


# One trainer rank with a process group of one (DCP's writer process joins a group that mirrors the trainers'):
# three background saves, training in place after each, then the checkpoints are loaded back.
WRITER_PROCESS_RUN = r"""
import json, multiprocessing, os, sys
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[2])
from shardkit.train.checkpoint import Checkpointer, WRITER_CHECK_NAME, complete_checkpoints
from test_checkpoint import make_state, save, train_steps

def main():
    dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + sys.argv[3])
    model, optimizer, scheduler = make_state(0)
    checkpointer = Checkpointer(sys.argv[1], rank=0, async_save=True)
    states = {}
    for step in (1, 2, 3):
        train_steps(model, optimizer, scheduler, 1)
        states[step] = {k: v.clone() for k, v in model.state_dict().items()}
        save(checkpointer, step, model, optimizer, scheduler)
        writers = [p.pid for p in multiprocessing.active_children()]
        train_steps(model, optimizer, scheduler, 1)  # in place, while the save may be in flight
        checkpointer.wait(join=False)
    checkpointer.wait()
    fresh = make_state(1)
    loaded = checkpointer.load(complete_checkpoints(sys.argv[1])[0][1], model=fresh[0], optimizer=fresh[1],
                               scheduler=fresh[2], world_size=1)
    same = all(torch.equal(v, states[3][k]) for k, v in fresh[0].state_dict().items())
    print(json.dumps({"writers": writers, "trainer": os.getpid(), "step": loaded.step, "same": same,
                      "loader": loaded.rank_state["loader"], "scratch_left": os.path.exists(
                          os.path.join(sys.argv[1], WRITER_CHECK_NAME))}))
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
"""


def test_background_saves_are_written_by_dcps_writer_process_and_it_stays_quiet(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(WRITER_PROCESS_RUN)
    tests = str(Path(__file__).resolve().parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(Path(tests).parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "checkpoints"), tests, str(free_port())],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(result["writers"]) == 1 and result["trainer"] not in result["writers"]  # another process wrote
    assert result["step"] == 3 and result["same"] and result["loader"] == {"consumed": 12}
    assert not result["scratch_left"]  # the writer's start-up check leaves nothing behind
    # DCP's writer process logs three INFO lines per save; only its start's are left.
    assert done.stderr.count("Received async checkpoint request") <= 1, done.stderr[-3000:]


def test_a_checkpoint_that_cannot_be_marked_complete_in_the_background_fails_the_next_wait(tmp_path, monkeypatch):
    model, optimizer, scheduler = make_state(0)
    checkpointer = Checkpointer(tmp_path, rank=0, async_save=True)  # no process group: the thread writer
    save(checkpointer, 1, model, optimizer, scheduler)
    checkpointer.wait()
    real_replace = os.replace

    def failing_replace(source, target):
        if str(source).endswith("step_00000002.partial"):
            raise OSError(5, "Input/output error")
        return real_replace(source, target)

    monkeypatch.setattr("shardkit.train.checkpoint.os.replace", failing_replace)
    save(checkpointer, 2, model, optimizer, scheduler)
    while not checkpointer.background_written():
        time.sleep(0.01)
    checkpointer.wait(join=False)  # the marking runs on in a thread; its failure is not lost
    with pytest.raises(OSError, match=r"step_00000002.partial could not be marked complete .*Input/output error.*"
                                      r"previous checkpoints are intact"):
        checkpointer.wait()
    assert find_latest(tmp_path).name == "step_00000001"
