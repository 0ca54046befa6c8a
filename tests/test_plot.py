"""`shardkit plot RUN_DIR`: a PNG from metrics.jsonl; clear errors on a missing or damaged log."""

from __future__ import annotations

import json

import pytest

from shardkit.cli import main
from shardkit.train.plot import plot_run, read_metrics

pytest.importorskip("matplotlib")


def write_metrics(run_dir, lines):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))


def test_plot_command_writes_a_png(tmp_path, capsys):
    records = [json.dumps({"step": s, "loss": 5.0 / s, "tokens_per_s": 1000.0 + s}) for s in range(1, 21)]
    records.append(json.dumps({"step": 20, "eval_loss": 0.3}))
    write_metrics(tmp_path / "run", records)
    assert main(["plot", str(tmp_path / "run")]) == 0
    png = tmp_path / "run" / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert str(png) in capsys.readouterr().out
    steps, evals = read_metrics(tmp_path / "run")
    assert len(steps) == 20 and evals == [{"step": 20, "eval_loss": 0.3}]


def test_plot_errors_name_the_file_and_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl not found"):
        plot_run(tmp_path)
    write_metrics(tmp_path, [json.dumps({"step": 1, "loss": 1.0, "tokens_per_s": 1.0}), "{oops"])
    with pytest.raises(ValueError, match=r"metrics.jsonl line 2 is damaged"):
        plot_run(tmp_path)
