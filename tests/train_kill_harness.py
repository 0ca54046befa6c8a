"""SIGKILL matrix for training, in the kill harness's manner: one long-lived process imports torch and
the trainer once but computes nothing itself (so every forked child starts with fresh thread pools),
then forks one training run per point and SIGKILLs it at a seeded random moment.

    python tests/train_kill_harness.py DATASET WORKDIR POINTS SEED [OPTIONS_JSON]   -> JSON figures on stdout

Each point: a run checkpointing every step is killed once it has checkpointed a seeded random number
of steps, plus a random part of a step (so during start-up, a step, or a checkpoint save), then resumed with
`--resume auto` to the end. Its per-step losses (and, under --precision fp16, loss scales and overflow-skipped
steps) must equal an uninterrupted run's bitwise, over the whole run every sample id must be consumed exactly
once, in the same steps as the reference, and the resumed run must report (`resumed_from` in metrics.jsonl) the
newest checkpoint the kill left: a run that started over would reproduce the reference too. OPTIONS_JSON holds
more trainer options ({"precision": "fp16", ...}; its "data" entries are added to the data options, e.g.
{"data": {"tokenizer": "byte"}} for raw text); the forked runs inherit the environment
(SHARDKIT_FAULT_INJECT="overflow:STEP" forces an overflow).

    python tests/train_kill_harness.py kill-torchrun RUN_DIR TARGET DELAY   -> JSON on stdout

The watcher for multi-process runs, from outside their process tree: it finds the torchrun launcher
whose command line names RUN_DIR, waits for its ranks and for a complete checkpoint of step >= TARGET,
sleeps DELAY seconds (a seeded random moment: in a step, a collective, a save), then SIGKILLs the
launcher and every rank at once (the ranks run in sessions of their own, out of the launcher's group).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kill_harness import _fork, _wait  # noqa: E402
from process_tree import descendants, signal_all  # noqa: E402
from train_runs import loss_scales, losses, sample_ids  # noqa: E402

STEPS = 8
DEADLINE = 120.0


def _train(data: str, run_dir: str, cache_dir: str, options: dict) -> None:
    import torch

    from shardkit.train.config import config_from_dict
    from shardkit.train.loop import build, close, train

    torch.set_num_threads(1)
    options = dict(options)
    values = {"steps": STEPS, "device": "cpu", "optimizer": {"warmup_steps": 2},
              "data": {"data": data, "batch_size": 12, "cache_dir": cache_dir, **options.pop("data", {})},
              "checkpoint": {"checkpoint_every": 1, "keep": 2, "resume": "auto"},
              "logging": {"run_dir": run_dir, "log_every": 1000, "tensorboard": False, "log_sample_ids": True},
              **options}
    run = build(config_from_dict(values))
    try:
        code = train(run)
    finally:
        close(run)
    if code:
        raise SystemExit(code)


def resumed_from(run_dir: Path) -> list[str]:
    """The checkpoints the attempts of a run resumed from, in order (the loop's `resumed_from` records)."""
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["resumed_from"] for r in records if "resumed_from" in r]


def _first_stream_shares(data: str, ids_by_step: dict) -> list[float] | None:
    """For a mixture (DATA holds several entries): the share of the first stream's samples in the first
    and the second half of the reference's steps (global sample ids count the first stream first)."""
    entries = data.split()
    if len(entries) < 2:
        return None
    from shardkit.manifest import load_manifest

    first = load_manifest(entries[0].rsplit(":", 1)[0]).num_samples
    steps = sorted(ids_by_step)
    halves = (steps[:len(steps) // 2], steps[len(steps) // 2:])
    shares = []
    for half in halves:
        ids = [i for step in half for i in ids_by_step[step]]
        shares.append(sum(i < first for i in ids) / max(len(ids), 1))
    return shares


def _reference_step_seconds(pid: int, run_dir: Path) -> float:
    """Wait for the reference run, watching its checkpoints appear: the seconds of one step (with its
    save), from the first checkpoint to the last. Not the whole run over STEPS: start-up weighs in that
    figure, and a random part of it after the last checkpoints outlived the run (a kill that missed)."""
    seen: dict[int, float] = {}
    give_up = time.monotonic() + DEADLINE
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        seen.setdefault(_latest_step(run_dir), time.monotonic())
        if done:
            break
        if time.monotonic() > give_up:
            os.kill(pid, signal.SIGKILL)
            raise SystemExit("the uninterrupted reference run did not end")
        time.sleep(0.002)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit("the uninterrupted reference run failed")
    steps = sorted(step for step in seen if step > 0)
    if len(steps) < 2:
        raise SystemExit(f"the reference run left checkpoints {steps}: expected one per step")
    return (seen[steps[-1]] - seen[steps[0]]) / (steps[-1] - steps[0])


def _latest_step(run_dir: Path) -> int:
    """Newest complete checkpoint's step (checkpoints appear by rename once complete), 0 if none."""
    try:
        names = os.listdir(run_dir / "checkpoints")
    except FileNotFoundError:
        return 0
    return max((int(name[5:]) for name in names if name.startswith("step_") and name[5:].isdigit()), default=0)


def train_matrix(data: str, workdir: str, points: int, seed: int, options: dict | None = None) -> dict:
    import torch  # noqa: F401 - imported once here so that forked children start at once
    import shardkit.train.loop  # noqa: F401

    rng = random.Random(seed)
    cache_dir = os.path.join(workdir, "cache")
    reference = Path(workdir) / "reference"
    began = time.monotonic()
    step_seconds = _reference_step_seconds(_fork(_train, data, str(reference), cache_dir, options or {}), reference)
    duration = time.monotonic() - began
    want_losses, want_ids, want_scales = losses(reference), sample_ids(reference), loss_scales(reference)
    figures = {"runs": points, "kills": 0, "killed_before_first_checkpoint": 0, "loss_mismatches": 0,
               "scale_mismatches": 0, "reference_loss_scales": want_scales,
               "id_mismatches": 0, "samples_checked": 0, "duplicated": 0, "lost": 0, "failed_resumes": 0,
               "resume_mismatches": 0, "resumed_from_checkpoint": 0,
               "reference_seconds": round(duration, 2),
               "reference_stream_shares": _first_stream_shares(data, want_ids)}
    for point in range(points):
        run_dir = Path(workdir) / f"run-{point:02d}"
        pid = _fork(_train, data, str(run_dir), cache_dir, options or {})
        # Kill by progress, not by the clock (this machine is shared): once the run has checkpointed
        # a seeded random number of steps (0: still starting up), plus a random part of one step.
        target = rng.randint(0, STEPS - 2)
        give_up = time.monotonic() + DEADLINE
        while _latest_step(run_dir) < target and time.monotonic() < give_up:
            time.sleep(0.002)
        time.sleep(rng.uniform(0, step_seconds))
        os.kill(pid, signal.SIGKILL)
        status = _wait(pid, DEADLINE)
        figures["kills"] += status == -signal.SIGKILL
        latest = _latest_step(run_dir)
        figures["killed_before_first_checkpoint"] += latest == 0
        if _wait(_fork(_train, data, str(run_dir), cache_dir, options or {}), DEADLINE) != 0:
            figures["failed_resumes"] += 1
            continue
        # A run that started over would also reproduce the reference: it must say it resumed, and from
        # the newest checkpoint the kill left (none: a fresh start).
        figures["resume_mismatches"] += resumed_from(run_dir) != ([f"step_{latest:08d}"] if latest else [])
        figures["resumed_from_checkpoint"] += bool(resumed_from(run_dir))
        got_ids = sample_ids(run_dir)
        figures["loss_mismatches"] += losses(run_dir) != want_losses
        figures["scale_mismatches"] += loss_scales(run_dir) != want_scales
        figures["id_mismatches"] += got_ids != want_ids
        consumed = [i for ids in got_ids.values() for i in ids]
        expected = {i for ids in want_ids.values() for i in ids}
        figures["samples_checked"] += len(consumed)
        figures["duplicated"] += len(consumed) - len(set(consumed))
        figures["lost"] += len(expected - set(consumed))
    figures["seconds"] = round(time.monotonic() - began, 2)
    return figures


def _find_launcher(run_dir: str) -> int | None:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    argv = handle.read().decode(errors="replace").split("\0")
            except OSError:
                continue
            if "torch.distributed.run" in argv and run_dir in argv:
                return int(entry)
    return None


def kill_torchrun(run_dir: str, target: int, delay: float) -> dict:
    give_up = time.monotonic() + DEADLINE
    launcher = None
    while launcher is None and time.monotonic() < give_up:
        launcher = _find_launcher(run_dir)
        time.sleep(0.01)
    if launcher is None:
        return {"killed": 0, "reason": "no torchrun names " + run_dir}
    while len(descendants(launcher)) < 2 and time.monotonic() < give_up:  # the launcher and two ranks
        time.sleep(0.01)
    while _latest_step(Path(run_dir)) < target and time.monotonic() < give_up:
        time.sleep(0.002)
    time.sleep(delay)
    tree = [launcher, *descendants(launcher)]  # before the launcher dies: its orphaned ranks could not be found after
    signal_all(tree, signal.SIGKILL)
    return {"killed": len(tree), "latest_step_at_kill": _latest_step(Path(run_dir))}


if __name__ == "__main__":
    if sys.argv[1] == "kill-torchrun":
        print(json.dumps(kill_torchrun(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))))
    else:
        options = json.loads(sys.argv[5]) if len(sys.argv) > 5 else None
        print(json.dumps(train_matrix(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), options)))
