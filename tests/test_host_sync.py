"""No host sync between logging steps (issue 31): the loop converts device numbers to Python numbers only at
its sync points. Counted on CPU: every call of Tensor.item/tolist/__float__/__int__/__bool__ on a floating-point
tensor made from the project's own files (on a GPU each of these waits for every kernel queued before it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from shardkit.train.config import config_from_dict
from shardkit.train.loop import build, close, train
from train_runs import write_byte_dataset

REPO = Path(__file__).resolve().parents[1]
CONVERSIONS = ("item", "tolist", "__float__", "__int__", "__bool__")


def _from_project(filename: str) -> bool:
    path = Path(filename)
    return path.is_relative_to(REPO) and not path.is_relative_to(REPO / "tests") and ".venv" not in path.parts


def count_conversions(monkeypatch, run) -> list[tuple[int, str]]:
    """(the step the run was at, where) for each conversion from the project's files, from now on."""
    seen: list[tuple[int, str]] = []
    for name in CONVERSIONS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            caller = sys._getframe(1).f_code
            if self.is_floating_point() and _from_project(caller.co_filename):
                seen.append((run.step, f"{Path(caller.co_filename).name}:{caller.co_name}"))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return seen


@pytest.mark.parametrize("extra", [{}, {"grad_accum": 2}, {"skip_steps": "3"}])
def test_the_loop_reads_device_numbers_once_per_logging_step_only(tmp_path, monkeypatch, extra):
    write_byte_dataset(str(tmp_path / "data"))
    run = build(config_from_dict({
        "steps": 10, "device": "cpu", "optimizer": {"warmup_steps": 2}, **extra,
        "data": {"data": str(tmp_path / "data"), "batch_size": 4, "cache_dir": str(tmp_path / "cache")},
        "logging": {"run_dir": str(tmp_path / "run"), "log_every": 4, "tensorboard": False},
        "checkpoint": {"save_final": False}}))
    try:
        conversions = count_conversions(monkeypatch, run)
        assert train(run) == 0
    finally:
        monkeypatch.undo()
        close(run)
    logging_steps = {1, 4, 8, 10}  # the first, every --log-every, the last
    per_step = {step: [where for s, where in conversions if s == step] for step in {s for s, _ in conversions}}
    assert set(per_step) <= logging_steps, per_step
    assert all(len(where) <= 1 for where in per_step.values()), per_step
    records = [line for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 10  # still one record per step
