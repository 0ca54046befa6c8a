"""A trainer rank that dies of a signal says where: every Python thread's stack on stderr (an intermittent SIGABRT
of a rank, "terminate called without an active exception", left no trace in torchrun's report before)."""

from __future__ import annotations

import subprocess
import sys


def test_trainer_process_prints_thread_stacks_when_aborted(tmp_path):
    script = ("from shardkit.train.__main__ import run_trainer\n"
              f"assert run_trainer(['--data', {str(tmp_path / 'absent')!r}]) == 2\n"
              "import os; os.abort()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode < 0, done.stderr
    assert "Fatal Python error: Aborted" in done.stderr and "Current thread" in done.stderr, done.stderr[-2000:]
