"""benchmarks/bench_train.py end to end in its CPU smoke mode: every case runs (the trainer's cases with the
exact options the GPU run passes, the bare loop) and the table and JSON come out (issue 31 item 5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_smoke_mode_runs_every_case_and_writes_the_table_and_commands(tmp_path):
    out = tmp_path / "train.json"
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_train.py"), "--smoke", "--data-dir",
                             str(tmp_path / "data"), "--out", str(out)], capture_output=True, text=True, timeout=900,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    cases = report["cases"]
    assert list(cases) == ["a", "b", "a-bare", "b-bare", "llama-1b", "plain-2048", "docmask-2048"]
    for name, case in cases.items():
        assert len(case["runs"]) == 1 and case["median"]["tokens_per_s"] > 0, name
    # The trainer derived 2 micro-steps from --global-batch-tokens (4 samples x 32 tokens x 2 = 256 per step).
    assert "--global-batch-tokens 256" in cases["b"]["command"]
    assert "one optimizer step holds 256 tokens" in result.stderr
    assert "--parallel fsdp --activation-checkpointing true" in cases["llama-1b"]["command"]
    assert "--document-mask true" in cases["docmask-2048"]["command"]
    assert cases["a"]["median"]["final_step"] == 4 and cases["a"]["median"]["final_loss"] > 0
    assert "| a | 1 |" in result.stdout and "trainer/bare" in result.stdout
