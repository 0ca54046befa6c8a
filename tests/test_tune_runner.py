"""The runner's metrics follower: records as the trainer appends them, and a file the trainer replaces."""

from __future__ import annotations

import json

from shardkit.train.metrics import truncate_jsonl
from shardkit.tune.runner import MetricsFollower


def _append(path, *records: dict, torn: str = "") -> None:
    with open(path, "a") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in records) + torn)


def test_a_trainer_resuming_in_the_run_directory_is_followed_from_the_new_files_start(tmp_path):
    """A killed attempt left steps 1-3 and a torn line; the next trainer resumes at step 1 and drops the rest
    (the file becomes shorter), then appends: the follower reads the new file, never bytes mid-record."""
    path = tmp_path / "metrics.jsonl"
    follower = MetricsFollower(path)
    assert follower.new_records() == []
    _append(path, *({"step": s, "loss": 10.0 - s} for s in (1, 2, 3)), torn='{"step": 4, "lo')
    assert [r["step"] for r in follower.new_records()] == [1, 2, 3]
    truncate_jsonl(path, 1)  # what the resuming trainer does first
    _append(path, {"step": 1, "resumed_from": "step_00000001"}, {"step": 2, "loss": 7.5})
    assert follower.new_records() == [{"step": 1, "loss": 9.0}, {"step": 1, "resumed_from": "step_00000001"},
                                      {"step": 2, "loss": 7.5}]
    _append(path, {"step": 3, "loss": 7.0})
    assert follower.new_records() == [{"step": 3, "loss": 7.0}]
