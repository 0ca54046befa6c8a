"""The framework runs of the integration tests (tests/*_runs.py): started in new processes, their shared arguments,
the dataset they read and the checks on the sample ids they record."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SAMPLES = 60  # 4 per rank per step: 15 steps per epoch on one rank, 7 on two (56 samples, 4 left out)


@pytest.fixture(scope="module")
def dataset_url(tmp_path_factory) -> str:
    """A fixed-length dataset of SAMPLES samples of 17 tokens in 3 shards (ids recoverable from the tokens);
    a test module that imports this fixture gets one for its tests."""
    from loader_helpers import write_fixed

    url = str(tmp_path_factory.mktemp("integration") / "data")
    write_fixed(url, SAMPLES, seq_len=16, per_shard=20)
    return url


def stopped_and_resumed(script: str, dataset_url: str, tmp_path: Path, *options, steps: int, ranks: int = 1):
    """(run stopped after step 10, that run resumed from step 10's checkpoint in a new process), each {rank:
    [[step, sample ids], ...]}, in tmp_path / "cut". Where the framework reads shardkit's batches as they come, the
    uninterrupted run they must add up to is `own_loader_steps` (in this process): no framework run to start."""
    (tmp_path / "cut").mkdir(exist_ok=True)
    head = run_script(script, dataset_url, tmp_path / "cut", "head", "--steps", steps, "--stop-at", 10, *options,
                      ranks=ranks)
    tail = run_script(script, dataset_url, tmp_path / "cut", "tail", "--steps", steps, "--resume", 10, *options,
                      ranks=ranks)
    return head, tail


def check_resumed(whole: dict, head: dict, tail: dict, *, first: int = 11) -> None:
    """Every rank: the resumed run starts at step `first` and the stopped and resumed runs together are the
    uninterrupted run (same sample ids at every step, none replayed, none missing)."""
    for rank in whole:
        assert tail[rank][0][0] == first
        assert head[rank] + tail[rank] == whole[rank]


def check_two_rank_epochs(whole: dict, steps=((1, 8), (8, 15))) -> None:
    """Each epoch's [first, last) steps: the two ranks' samples disjoint and together the 56 samples it uses."""
    for first, last in steps:
        shares = [ids_of(whole[rank], first, last) for rank in range(2)]
        assert not set(shares[0]) & set(shares[1])
        assert len(set(shares[0] + shares[1])) == len(shares[0] + shares[1]) == 56


def check_elastic(head: dict, one: list, whole_one: list, *, resumed_at: int = 10, epoch_start=(8, 16)) -> None:
    """Two ranks stopped after step `resumed_at` (`head`) and resumed on one (`one`), against an uninterrupted
    one-rank run (`whole_one`); `epoch_start`: the step at which the unfinished epoch began on two ranks and on one
    (the same batch per rank). What the two ranks read of that epoch is together what the one-rank run read up to
    the same position, and every resumed step reads what the one-rank run read at the same position."""
    at = epoch_start[1] + 2 * (resumed_at - epoch_start[0] + 1)  # the one-rank step at the resumed position
    read = ids_of(head[0], epoch_start[0]) + ids_of(head[1], epoch_start[0])
    assert sorted(read) == sorted(ids_of(whole_one, epoch_start[1], at))
    assert one[0][0] == resumed_at + 1
    steps = dict((step, ids) for step, ids in whole_one)
    assert len(steps) >= at + len(one) - 1, "the uninterrupted run is too short to compare"
    assert [ids for _, ids in one] == [steps[at + i] for i in range(len(one))]


def write_ids(path: str, seen: list) -> None:
    """A run script's last act: the ids it saw to PATH.RANK, and the process group closed."""
    import torch.distributed as dist

    with open(f"{path}.{os.environ.get('RANK', 0)}", "w") as f:
        json.dump(seen, f)
    # End the process group before the interpreter does: left to exit, gloo's threads were torn down mid-flight
    # after finished 2-rank runs ("terminate called without an active exception", exit -6). destroy_process_group
    # is not enough when the framework still holds the group (DDP's reducer in a transformers run did, once in CI):
    # its gloo worker threads then die in the interpreter's finalization (pytorch/pytorch#179291 describes it). The
    # ids are written and the ranks agreed: the process leaves without that finalization.
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_script(script: str, dataset_url: str, folder: Path, name: str, *options, ranks: int = 1, check: bool = True,
               torchrun: bool = False, env: dict[str, str] | None = None):
    """Run `script` in a new process (torchrun for several ranks or with `torchrun`, gloo; `env` added to its
    environment); {rank: [[step, sample ids], ...]} it recorded, or the finished process when `check` is off."""
    from conftest import free_port

    folder.mkdir(parents=True, exist_ok=True)
    command = [str(HERE / script), dataset_url, str(folder), str(folder.parent / name), *map(str, options)]
    launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
                 f"--master-port={free_port()}"] if ranks > 1 or torchrun else [sys.executable])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    done = subprocess.run(launcher + command, capture_output=True, text=True, env=env, timeout=600)
    if not check:
        return done
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {rank: json.loads((folder.parent / f"{name}.{rank}").read_text()) for rank in range(ranks)}


def torchrun_worker_env(rank: int, world_size: int) -> dict[str, str]:
    """The environment torchrun gives worker `rank` of `world_size` on one node (what a framework and the dataset
    read to learn their place), for a test of what one worker does before it meets the others: that worker alone,
    without torchrun's agent process and the other workers (no agent store to join: a process group would use
    MASTER_ADDR/MASTER_PORT)."""
    from conftest import free_port

    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "False"}


def own_loader_steps(dataset_url: str | list[str], cache_dir: str | None, *, steps: int, ranks: int = 1,
                     batch_size: int | None = 4, **options) -> dict[int, list]:
    """{rank: [[step, sample ids], ...]} of steps 1..`steps` as shardkit's own StreamingDataLoader reads them (in
    this process, each rank told its place), through as many epochs as it takes: what a framework run must read.
    `cache_dir` None: none given (raw text); `batch_size` None: the dataset batches (token budgets)."""
    import itertools

    from shardkit import StreamingDataLoader, StreamingDataset

    read = {}
    for rank in range(ranks):
        cache = {} if cache_dir is None else {"cache_dir": cache_dir}
        loader = StreamingDataLoader(StreamingDataset(dataset_url, rank=rank, world_size=ranks, **cache, **options),
                                     batch_size=batch_size)
        batches = itertools.chain.from_iterable(loader for _ in itertools.count())
        read[rank] = [[step, batch["sample_id"].tolist()]
                      for step, batch in zip(range(1, steps + 1), batches)]
    return read


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
