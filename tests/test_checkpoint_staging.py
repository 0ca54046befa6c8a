"""Background saves staged by `FlatStager` (shared-memory buffers kept for the run, expanded again by
`ExpandingSavePlanner` where DCP writes), their state dicts built by `SaveStateDict` after the first save: the
checkpoint holds what a synchronous save of the same state holds, entry for entry, and loads back model,
optimizer, scheduler and the loader's state; the buffers are reused by the next save, which then holds its own
step's state.

In one process (no process group) the background save is written by a thread; with a group, by DCP's
writer process (tests/test_checkpoint_async.py's torchrun job, which checks this staging was used).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import torch

from shardkit.train.checkpoint import STATE_DICT_OPTIONS, WRITER_CHECK_NAME, Checkpointer, find_latest
from shardkit.train.checkpoint_metadata import SafeFileSystemReader
from shardkit.train.checkpoint_staging import FlatStager, flat_stageable
from shardkit.train.checkpoint_state import SaveStateDict
from shardkit.train.checkpoint_writer import expand_flat_state
from test_checkpoint import make_state, train_steps

LOADER = {"epoch": 0, "consumed": 8, "lanes": [3, 5], "nested": {"shard": "a/b.bin", "offset": 12}}


def _save(checkpointer, step, model, optimizer, scheduler):
    checkpointer.save(step, model=model, optimizer=optimizer, scheduler=scheduler,
                      rank_state={"loader": {**LOADER, "consumed": step * 4}}, meta={"world_size": 1})


def _entries(path) -> dict[str, tuple]:
    """Every entry DCP's index records: the tensors' shapes and dtypes, and the non-tensor values by name."""
    metadata = SafeFileSystemReader(path).read_metadata()
    return {key: (tuple(getattr(entry, "size", ())), str(getattr(getattr(entry, "properties", None), "dtype", "")))
            for key, entry in metadata.state_dict_metadata.items()}


def test_a_flat_staged_save_holds_what_a_synchronous_save_holds_and_loads_back(tmp_path):
    model, optimizer, scheduler = make_state(0)
    train_steps(model, optimizer, scheduler, 2)
    _save(Checkpointer(tmp_path / "sync", rank=0), 2, model, optimizer, scheduler)

    checkpointer = Checkpointer(tmp_path / "flat", rank=0, async_save=True)
    _save(checkpointer, 2, model, optimizer, scheduler)
    assert isinstance(checkpointer._stager, FlatStager)  # not DCP's stager: the path under test
    assert checkpointer._save_state_dict.usable  # later saves' state dicts are built without get_state_dict
    checkpointer.wait()
    staged_buffers = dict(checkpointer._stager._buffers)
    assert _entries(find_latest(tmp_path / "flat")) == _entries(find_latest(tmp_path / "sync"))

    train_steps(model, optimizer, scheduler, 2)  # the next save copies into the same buffers
    expected = ({k: v.clone() for k, v in model.state_dict().items()},
                {i: {k: v.clone() for k, v in s.items()} for i, s in optimizer.state_dict()["state"].items()},
                optimizer.param_groups[0]["lr"])
    _save(checkpointer, 4, model, optimizer, scheduler)
    assert all(checkpointer._stager._buffers[k] is b for k, b in staged_buffers.items())
    train_steps(model, optimizer, scheduler, 1)  # the live tensors move on while the save is written
    checkpointer.wait()

    fresh = make_state(1)
    loaded = checkpointer.load(find_latest(tmp_path / "flat"), model=fresh[0], optimizer=fresh[1],
                               scheduler=fresh[2], world_size=1)
    assert loaded.step == 4 and loaded.rank_state["loader"] == {**LOADER, "consumed": 16}
    saved_model, saved_optimizer, saved_lr = expected
    for name, tensor in fresh[0].state_dict().items():
        assert torch.equal(tensor, saved_model[name]), name
    for index, state in fresh[1].state_dict()["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], saved_optimizer[index][key]), (index, key)
    assert fresh[1].param_groups[0]["lr"] == saved_lr and fresh[2].last_epoch == 4


def test_a_save_while_the_writer_process_starts_is_written_synchronously(tmp_path):
    model, optimizer, scheduler = make_state(0)
    checkpointer = Checkpointer(tmp_path, rank=0, async_save=True)
    starting = Future()  # what Checkpointer._start_writer leaves pending: DCP's writer process, still starting
    checkpointer._pending = (starting, tmp_path / WRITER_CHECK_NAME, None)
    threading.Timer(3, starting.set_result, [None]).start()  # ready in 3 s: a save that waited would then go on
    _save(checkpointer, 2, model, optimizer, scheduler)
    assert find_latest(tmp_path).name == "step_00000002"  # complete on return: written without the writer
    assert checkpointer._pending[0] is starting and not starting.done()
    starting.result(timeout=30)
    checkpointer.wait(join=False)  # what the loop's sync point does once every rank's writer has started
    assert not checkpointer.saving_in_background
    train_steps(model, optimizer, scheduler, 1)
    _save(checkpointer, 3, model, optimizer, scheduler)  # the writer is up: in the background again
    assert checkpointer.saving_in_background
    checkpointer.wait()
    assert [p.name for p in sorted(tmp_path.glob("step_*"))] == ["step_00000002", "step_00000003"]


def test_expanding_a_flat_staged_state_gives_back_every_entry():
    model, optimizer, _ = make_state(0)
    state = {"model": model.state_dict(), "optim": {"state.w.step": torch.tensor(3.0),
                                                    "param_groups.w.betas": (0.9, 0.95)},
             "train": '{"step": 3}', "rank_0": "{}", "empty": {}, "counts": torch.arange(4)}
    assert flat_stageable(state)
    staged = FlatStager().stage(state)
    assert len(staged) == 1  # one compact entry: its buffers (one per dtype), layout and values
    expanded = expand_flat_state(staged)
    assert expanded.keys() == state.keys() and expanded["model"].keys() == state["model"].keys()
    for name, tensor in state["model"].items():
        assert torch.equal(expanded["model"][name], tensor) and expanded["model"][name].data_ptr() != tensor.data_ptr()
    assert torch.equal(expanded["counts"], state["counts"]) and expanded["counts"].dtype == torch.int64
    assert expanded["optim"]["param_groups.w.betas"] == (0.9, 0.95)
    assert (expanded["train"], expanded["rank_0"], expanded["empty"]) == ('{"step": 3}', "{}", {})


def test_a_state_the_cheap_build_does_not_know_is_built_by_get_state_dict():
    model, optimizer, scheduler = make_state(0)
    train_steps(model, optimizer, scheduler, 1)
    parameter = next(iter(optimizer.state))
    optimizer.state[parameter]["nested"] = {"moment": torch.zeros(1)}  # nested state: flattened by DCP alone
    build = SaveStateDict(STATE_DICT_OPTIONS)
    model_state, optim_state = build(model, optimizer)
    assert build.usable is False and any(key.endswith(".nested.moment") for key in optim_state)
    assert build(model, optimizer)[1].keys() == optim_state.keys()


def test_states_with_tensors_it_cannot_stage_go_to_dcps_stager():
    assert not flat_stageable({"model": {"w": torch.zeros(2).to_sparse()}})
    assert not flat_stageable({"extra": [torch.zeros(2)]})  # a tensor inside a list
    assert flat_stageable({"extra": [1, 2], "w": torch.zeros(2)})
