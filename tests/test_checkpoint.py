"""Checkpointer in one process: round trip, completion marker, keep-K, async save, safe loading, RNG state."""

from __future__ import annotations

import enum
import json
import pathlib
import pickle
import random
import re
import time

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from shardkit.train import rng
from shardkit.train.checkpoint import (MARKER_NAME, Checkpointer, SafeLoadPlanner, checkpoint_problem, find_latest,
                                       find_resumable, read_marker)
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


def damage(checkpoint, how: str) -> str:
    """Truncate the largest DCP file, delete the metadata, or cut the marker short; returns the file's name."""
    if how == "truncate":
        victim = max((p for p in checkpoint.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    elif how == "delete":
        victim = checkpoint / ".metadata"
        victim.unlink()
    else:
        victim = checkpoint / MARKER_NAME
        victim.write_text(victim.read_text()[:40])
    return victim.name


@pytest.mark.parametrize("how, problem", [("truncate", "has .* bytes, the marker says"),
                                          ("delete", r"\.metadata is missing"),
                                          ("marker", f"{MARKER_NAME} is damaged")])
def test_a_damaged_checkpoint_is_detected_before_loading_and_skipped(tmp_path, how, problem):
    model, optimizer, scheduler = make_state(0)
    checkpointer = Checkpointer(tmp_path, rank=0)
    for step in (1, 2):
        train_steps(model, optimizer, scheduler, 1)
        save(checkpointer, step, model, optimizer, scheduler)
    assert checkpoint_problem(tmp_path / "step_00000002") is None
    assert set(read_marker(tmp_path / "step_00000002")["files"]) == {".metadata", "__0_0.distcp"}
    damage(tmp_path / "step_00000002", how)
    newest, skipped = find_resumable(tmp_path)
    assert newest.name == "step_00000001"
    assert [path.name for path, _ in skipped] == ["step_00000002"] and re.search(problem, skipped[0][1])
    fresh = make_state(1)
    with pytest.raises(ValueError, match=f"checkpoint .*step_00000002 is damaged: (.* )?{problem}"):
        checkpointer.load(tmp_path / "step_00000002", model=fresh[0], optimizer=fresh[1], scheduler=fresh[2],
                          world_size=1)
    assert checkpointer.load(newest, model=fresh[0], optimizer=fresh[1], scheduler=fresh[2], world_size=1).step == 1
    damage(tmp_path / "step_00000001", how)
    assert find_resumable(tmp_path)[0] is None and len(find_resumable(tmp_path)[1]) == 2


def test_same_size_damage_is_a_clear_error_naming_the_checkpoint(tmp_path):
    """Bytes overwritten in place keep the sizes the marker lists: DCP's failure is named, not dumped."""
    model, optimizer, scheduler = make_state(0)
    Checkpointer(tmp_path, rank=0).save(1, model=model, optimizer=optimizer, scheduler=scheduler,
                                        rank_state={}, meta={"world_size": 1})
    metadata = tmp_path / "step_00000001" / ".metadata"
    metadata.write_bytes(b"\0" * metadata.stat().st_size)
    fresh = make_state(1)
    with pytest.raises(ValueError, match="checkpoint .*step_00000001 cannot be loaded"):
        Checkpointer(tmp_path, rank=0).load(tmp_path / "step_00000001", model=fresh[0], optimizer=fresh[1],
                                            scheduler=fresh[2], world_size=1)


def test_resume_auto_falls_back_past_a_damaged_newest_checkpoint(tmp_path, capsys, caplog, figures):
    """End to end through the training loop: the newest checkpoint damaged (each way) -> the run resumes
    from the previous one, says which it skipped, and repeats the lost steps exactly; none valid -> one line."""
    from shardkit.cli import main
    from train_runs import losses, write_byte_dataset

    write_byte_dataset(str(tmp_path / "data"), num_samples=48)
    argv = ["train", "--data", str(tmp_path / "data"), "--steps", "4", "--warmup-steps", "1", "--batch-size", "4",
            "--checkpoint-every", "2", "--device", "cpu", "--run-dir", str(tmp_path / "run"),
            "--cache-dir", str(tmp_path / "cache"), "--tensorboard", "false"]
    assert main(argv) == 0
    reference = losses(tmp_path / "run")
    checkpoints = tmp_path / "run" / "checkpoints"
    counts = {"runs": 1, "damaged": 0, "resumed_from_previous": 0, "loss_mismatches": 0, "refused_in_one_line": 0}
    for how in ("truncate", "delete", "marker"):
        damaged = damage(checkpoints / "step_00000004", how)
        counts["damaged"] += 1
        capsys.readouterr()
        caplog.clear()
        assert main(argv) == 0
        counts["runs"] += 1
        out = capsys.readouterr().out
        assert "step_00000002 at step 2 (skipped damaged step_00000004)" in out, out
        counts["resumed_from_previous"] += 1
        assert any("skipping damaged checkpoint" in r.message and "step_00000004" in r.message
                   and damaged in r.message for r in caplog.records)
        counts["loss_mismatches"] += losses(tmp_path / "run") != reference  # steps 3 and 4 again, bit for bit
        records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [r["resumed_from"] for r in records if "resumed_from" in r] == ["step_00000002"] * counts["resumed_from_previous"]
    assert counts["loss_mismatches"] == 0
    # Every rerun saved a sound step 4 over the damaged one; now damage every checkpoint.
    for checkpoint in checkpoints.iterdir():
        damage(checkpoint, "delete")
        counts["damaged"] += 1
    assert main(argv) == 2
    counts["runs"] += 1
    err = capsys.readouterr().err.strip()
    errors = [line for line in err.splitlines() if "error:" in line]
    assert "Traceback" not in err and len(errors) == 1, err
    assert "error: no valid checkpoint in" in errors[0] and "step_00000004: .metadata is missing" in errors[0], err
    counts["refused_in_one_line"] += 1
    figures.add("damaged_checkpoint", **counts)


class RunsCode:
    """What an attacker puts into a `.metadata`: unpickling it calls `exec`."""

    def __init__(self, flag):
        self.flag = str(flag)

    def __reduce__(self):
        return exec, (f"open({self.flag!r}, 'w').write('ran')",)


def tamper_metadata(checkpoint, change, pickler=pickle.Pickler) -> None:
    """Rewrite a checkpoint's DCP index through `change(metadata)` (with `pickler`), and its marker's size to match
    (as an attacker who controls the files would)."""
    path = checkpoint / ".metadata"
    with open(path, "rb") as handle:
        metadata = pickle.load(handle)  # our own, just written: trusted here
    change(metadata)
    with open(path, "wb") as handle:
        pickler(handle).dump(metadata)
    marker = json.loads((checkpoint / MARKER_NAME).read_text())
    marker["files"][".metadata"] = path.stat().st_size
    (checkpoint / MARKER_NAME).write_text(json.dumps(marker))


def planting(flag):
    return lambda metadata: metadata.planner_data.update(evil=RunsCode(flag))


def test_a_crafted_metadata_is_refused_and_runs_no_code(tmp_path):
    model, optimizer, scheduler = make_state(0)
    checkpointer = Checkpointer(tmp_path / "ck", rank=0)
    save(checkpointer, 1, model, optimizer, scheduler)
    checkpoint, flag = find_latest(tmp_path / "ck"), tmp_path / "pwned"
    with open(checkpoint / ".metadata", "rb") as handle:
        pickle.load(handle)  # an ordinary checkpoint's index passes the restricted reader below as well
    tamper_metadata(checkpoint, planting(flag))
    fresh = make_state(1)
    with pytest.raises(ValueError, match=r"\.metadata refers to builtins\.exec, which is not a checkpoint metadata type"):
        checkpointer.load(checkpoint, model=fresh[0], optimizer=fresh[1], scheduler=fresh[2], world_size=1)
    assert not flag.exists()


def enums_as(owner_and_name):
    """A pickler that writes each enum member as Python 3.11.0-3.11.4 does, `getattr(owner, name)` (here with the
    owner and name `owner_and_name(member)` gives)."""
    class OldEnumPickler(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, enum.Enum):
                return getattr, owner_and_name(obj)
            return NotImplemented
    return OldEnumPickler


def test_a_metadata_written_by_python_3_11_early_releases_loads(tmp_path):
    """Debian 12's Python 3.11.2 pickles the index's enum members (`_MEM_FORMAT_ENCODING`) through
    `builtins.getattr`: such a checkpoint resumes exactly, while a getattr of anything but an admitted enum's member
    is refused."""
    model, optimizer, scheduler = make_state(0)
    checkpointer = Checkpointer(tmp_path / "ck", rank=0)
    save(checkpointer, 1, model, optimizer, scheduler)
    checkpoint = find_latest(tmp_path / "ck")
    tamper_metadata(checkpoint, lambda metadata: None, enums_as(lambda member: (type(member), member.name)))
    with open(checkpoint / ".metadata", "rb") as handle:
        assert b"getattr" in handle.read()
    fresh = make_state(1)
    checkpointer.load(checkpoint, model=fresh[0], optimizer=fresh[1], scheduler=fresh[2], world_size=1)
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh[0].state_dict()[name], tensor), name
    tamper_metadata(checkpoint, lambda metadata: None, enums_as(lambda member: (pathlib.PosixPath, "cwd")))
    with pytest.raises(ValueError, match=r"\.metadata looks up PosixPath\.cwd through getattr, which is not an enum"):
        checkpointer.load(checkpoint, model=fresh[0], optimizer=fresh[1], scheduler=fresh[2], world_size=1)


def test_a_metadata_pointing_outside_the_checkpoint_is_refused(tmp_path):
    model, optimizer, scheduler = make_state(0)
    checkpointer = Checkpointer(tmp_path / "ck", rank=0)
    save(checkpointer, 1, model, optimizer, scheduler)
    checkpoint = find_latest(tmp_path / "ck")

    def escape(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = "../../outside.distcp"
    tamper_metadata(checkpoint, escape)
    fresh = make_state(1)
    with pytest.raises(ValueError, match=r"'\.\./\.\./outside\.distcp', outside its checkpoint directory"):
        checkpointer.load(checkpoint, model=fresh[0], optimizer=fresh[1], scheduler=fresh[2], world_size=1)


def test_a_storage_file_linked_outside_the_checkpoint_is_refused(tmp_path):
    """A `__0_0.distcp` that is a symbolic link to a file elsewhere (of the listed size, as an attacker or a
    careless copy makes it) is refused naming it, by `--resume DIR` and by `--resume auto`; a link that
    stays inside the checkpoint loads."""
    model, optimizer, scheduler = make_state(0)
    checkpointer = Checkpointer(tmp_path / "ck", rank=0)
    for step in (1, 2):
        save(checkpointer, step, model, optimizer, scheduler)
    newest = tmp_path / "ck" / "step_00000002"
    storage_file = newest / "__0_0.distcp"
    outside = tmp_path / "elsewhere.distcp"
    storage_file.rename(outside)
    storage_file.symlink_to(outside)
    fresh = make_state(1)
    with pytest.raises(ValueError, match=r"step_00000002 is damaged: __0_0\.distcp is a symbolic link to "
                                         r".*elsewhere\.distcp, outside the checkpoint: refused"):
        checkpointer.load(newest, model=fresh[0], optimizer=fresh[1], scheduler=fresh[2], world_size=1)
    resumable, skipped = find_resumable(tmp_path / "ck")
    assert resumable.name == "step_00000001" and [path.name for path, _ in skipped] == ["step_00000002"]
    storage_file.unlink()
    outside.rename(newest / "kept-inside.bin")
    storage_file.symlink_to("kept-inside.bin")
    assert checkpointer.load(newest, model=fresh[0], optimizer=fresh[1], scheduler=fresh[2], world_size=1).step == 2
