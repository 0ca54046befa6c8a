"""SHARDKIT_TEST_CPU (tests/conftest_cpu.py): each test's CPU-seconds, those of the processes it waited for
included, as one JSON line a test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

BUSY_CHILD = '''
import subprocess, sys

def test_busy_child():
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(2_000_000))"], check=True)

def test_idle():
    pass
'''


def test_a_test_is_charged_the_cpu_of_the_processes_it_ran(tmp_path):
    (tmp_path / "test_busy.py").write_text(BUSY_CHILD)
    report = tmp_path / "cpu.jsonl"
    env = {**os.environ, "SHARDKIT_TEST_CPU": str(report), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                           "conftest_cpu", "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    records = {r["test"].rsplit("::", 1)[-1]: r for r in map(json.loads, report.read_text().splitlines())}
    assert sorted(records) == ["test_busy_child", "test_idle"]
    assert records["test_busy_child"]["children"] > 0.1 > records["test_idle"]["children"]
    assert records["test_idle"]["self"] < records["test_busy_child"]["self"] + records["test_busy_child"]["children"]
