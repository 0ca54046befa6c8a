"""Starting the framework runs of the integration tests (tests/hf_runs.py, tests/titan_runs.py) in new processes."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_script(script: str, dataset_url: str, folder: Path, name: str, *options, ranks: int = 1, check: bool = True):
    """Run `script` in a new process (torchrun for several ranks, gloo); {rank: [[step, sample ids], ...]} it
    recorded, or the finished process when `check` is off."""
    from conftest import free_port

    command = [str(HERE / script), dataset_url, str(folder), str(folder.parent / name), *map(str, options)]
    launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
                 f"--master-port={free_port()}"] if ranks > 1 else [sys.executable])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(launcher + command, capture_output=True, text=True, env=env, timeout=600)
    if not check:
        return done
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {rank: json.loads((folder.parent / f"{name}.{rank}").read_text()) for rank in range(ranks)}


def ids_of(steps, first: int = 0, last: int | None = None) -> list[int]:
    """Sample ids of the recorded steps in [first, last)."""
    return [i for step, ids in steps if first <= step and (last is None or step < last) for i in ids]


def run_parser() -> argparse.ArgumentParser:
    """The arguments every run script takes: the dataset, its output folder, where to write the ids it saw,
    the steps to train and the step after which to stop (as a preemption would)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("dataset")
    parser.add_argument("folder")
    parser.add_argument("ids")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--stop-at", type=int)
    return parser
