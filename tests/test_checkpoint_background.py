"""Background saves finished by the save thread (`shardkit.train.checkpoint_background`): after the first save
the loop hands a save over after the loader's state, and the thread copies the model and optimizer state while
training goes on. The checkpoint must still be the saved step's state, byte for byte: the next optimizer step
waits for the copy, and what changes without an optimizer step (the learning rate, on a skipped step) was taken
by the loop. Each test slows the thread's copy down so that training certainly runs while it is pending, and
compares the background checkpoint with a synchronous save of the same step, entry by entry.
"""

from __future__ import annotations

import time

import pytest
import torch

from shardkit.train.checkpoint import Checkpointer, find_latest
from shardkit.train.checkpoint_background import SaveThread
from shardkit.train.checkpoint_state import SaveStateDict
from test_checkpoint import make_state, save, train_steps


def _slow_copy(monkeypatch) -> None:
    submit = SaveThread.submit

    def slow_submit(self, copy, hand_over):
        def slow_copy():
            time.sleep(0.5)  # the whole copy is pending while the test trains on
            return copy()

        return submit(self, slow_copy, hand_over)

    monkeypatch.setattr(SaveThread, "submit", slow_submit)


def _loaded(checkpointer: Checkpointer, path):
    model, optimizer, scheduler = make_state(7)
    checkpointer.load(path, model=model, optimizer=optimizer, scheduler=scheduler, world_size=1)
    return model.state_dict(), optimizer.state_dict(), scheduler.state_dict()


def _assert_same(background, synchronous) -> None:
    (model, optimizer, scheduler), (model_sync, optimizer_sync, scheduler_sync) = background, synchronous
    for name, tensor in model_sync.items():
        assert torch.equal(model[name], tensor), name
    for index, state in optimizer_sync["state"].items():
        for key, value in state.items():
            assert torch.equal(optimizer["state"][index][key], value), (index, key)
    assert optimizer["param_groups"] == optimizer_sync["param_groups"]  # the learning rate at the save among them
    assert scheduler == scheduler_sync


@pytest.mark.parametrize("skipped_step_first", [False, True])
def test_a_save_finished_in_the_background_holds_its_steps_state_byte_for_byte(tmp_path, monkeypatch,
                                                                                skipped_step_first):
    model, optimizer, scheduler = make_state(0)
    background = Checkpointer(tmp_path / "background", rank=0, async_save=True)
    train_steps(model, optimizer, scheduler, 1)
    save(background, 1, model, optimizer, scheduler)  # the first save, in the loop: it learns the state's layout
    assert background._save_thread is not None  # later saves go to the thread under test
    train_steps(model, optimizer, scheduler, 2)
    save(Checkpointer(tmp_path / "synchronous", rank=0), 3, model, optimizer, scheduler)

    _slow_copy(monkeypatch)
    save(background, 3, model, optimizer, scheduler)
    if skipped_step_first:  # --skip-steps or an fp16 overflow: the schedule moves on without an optimizer step
        scheduler.step()
    train_steps(model, optimizer, scheduler, 2)  # the first optimizer step waits for the thread's copy
    background.wait()

    assert find_latest(tmp_path / "background").name == "step_00000003"
    _assert_same(_loaded(background, find_latest(tmp_path / "background")),
                 _loaded(background, find_latest(tmp_path / "synchronous")))


def test_a_copy_that_fails_in_the_thread_fails_the_next_wait_and_does_not_hold_the_optimizer(tmp_path, monkeypatch):
    model, optimizer, scheduler = make_state(0)
    checkpointer = Checkpointer(tmp_path, rank=0, async_save=True)
    train_steps(model, optimizer, scheduler, 1)
    save(checkpointer, 1, model, optimizer, scheduler)

    def failing_build(self, *args, **kwargs):
        raise ValueError("the model's or optimizer's state changed its layout")

    monkeypatch.setattr(SaveStateDict, "build", failing_build)
    save(checkpointer, 2, model, optimizer, scheduler)
    train_steps(model, optimizer, scheduler, 1)  # returns: the guard does not wait forever for a failed copy
    assert checkpointer.background_written()  # so that every rank goes on to `wait`, which raises
    with pytest.raises(OSError, match=r"checkpoint step 2 could not be written .*changed its layout"):
        checkpointer.wait()
    checkpointer.wait()  # what the run's close does: the previous checkpoint's marking is finished
    assert find_latest(tmp_path).name == "step_00000001"
