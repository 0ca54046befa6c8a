"""SIGKILL matrix for training, in the kill harness's manner: one long-lived process imports torch and
the trainer once but computes nothing itself (so every forked child starts with fresh thread pools),
then forks one training run per point and SIGKILLs it at a seeded random moment.

    python tests/train_kill_harness.py DATASET WORKDIR POINTS SEED   -> JSON figures on stdout

Each point: a run checkpointing every step is killed once it has checkpointed a seeded random number
of steps, plus a random part of a step (so during start-up, a step, or a checkpoint save), then resumed with `--resume auto` to the
end. Its per-step losses must equal an uninterrupted run's bitwise, and over the whole run every
sample id must be consumed exactly once, in the same steps as the reference.
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
from train_runs import losses, sample_ids  # noqa: E402

STEPS = 8
DEADLINE = 120.0


def _train(data: str, run_dir: str, cache_dir: str) -> None:
    import torch

    from shardkit.train.config import config_from_dict
    from shardkit.train.loop import build, close, train

    torch.set_num_threads(1)
    values = {"steps": STEPS, "device": "cpu", "optimizer": {"warmup_steps": 2},
              "data": {"data": data, "batch_size": 12, "cache_dir": cache_dir},
              "checkpoint": {"checkpoint_every": 1, "keep": 2, "resume": "auto"},
              "logging": {"run_dir": run_dir, "log_every": 1000, "tensorboard": False, "log_sample_ids": True}}
    run = build(config_from_dict(values))
    try:
        code = train(run)
    finally:
        close(run)
    if code:
        raise SystemExit(code)


def _latest_step(run_dir: Path) -> int:
    """Newest complete checkpoint's step (checkpoints appear by rename once complete), 0 if none."""
    try:
        names = os.listdir(run_dir / "checkpoints")
    except FileNotFoundError:
        return 0
    return max((int(name[5:]) for name in names if name.startswith("step_") and name[5:].isdigit()), default=0)


def train_matrix(data: str, workdir: str, points: int, seed: int) -> dict:
    import torch  # noqa: F401 - imported once here so that forked children start at once
    import shardkit.train.loop  # noqa: F401

    rng = random.Random(seed)
    cache_dir = os.path.join(workdir, "cache")
    reference = Path(workdir) / "reference"
    began = time.monotonic()
    if _wait(_fork(_train, data, str(reference), cache_dir), DEADLINE) != 0:
        raise SystemExit("the uninterrupted reference run failed")
    duration = time.monotonic() - began
    want_losses, want_ids = losses(reference), sample_ids(reference)
    figures = {"runs": points, "kills": 0, "killed_before_first_checkpoint": 0, "loss_mismatches": 0,
               "id_mismatches": 0, "samples_checked": 0, "duplicated": 0, "lost": 0, "failed_resumes": 0,
               "reference_seconds": round(duration, 2)}
    for point in range(points):
        run_dir = Path(workdir) / f"run-{point:02d}"
        pid = _fork(_train, data, str(run_dir), cache_dir)
        # Kill by progress, not by the clock (this machine is shared): once the run has checkpointed
        # a seeded random number of steps (0: still starting up), plus a random part of one step.
        target = rng.randint(0, STEPS - 2)
        give_up = time.monotonic() + DEADLINE
        while _latest_step(run_dir) < target and time.monotonic() < give_up:
            time.sleep(0.002)
        time.sleep(rng.uniform(0, duration / STEPS))
        os.kill(pid, signal.SIGKILL)
        status = _wait(pid, DEADLINE)
        figures["kills"] += status == -signal.SIGKILL
        figures["killed_before_first_checkpoint"] += _latest_step(run_dir) == 0
        if _wait(_fork(_train, data, str(run_dir), cache_dir), DEADLINE) != 0:
            figures["failed_resumes"] += 1
            continue
        got_ids = sample_ids(run_dir)
        figures["loss_mismatches"] += losses(run_dir) != want_losses
        figures["id_mismatches"] += got_ids != want_ids
        consumed = [i for ids in got_ids.values() for i in ids]
        expected = {i for ids in want_ids.values() for i in ids}
        figures["samples_checked"] += len(consumed)
        figures["duplicated"] += len(consumed) - len(set(consumed))
        figures["lost"] += len(expected - set(consumed))
    figures["seconds"] = round(time.monotonic() - began, 2)
    return figures


if __name__ == "__main__":
    print(json.dumps(train_matrix(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
