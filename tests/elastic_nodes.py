"""Simulated nodes for the elastic-training tests and benchmark: one real `torchrun` elastic agent per node.

Each `Node` is what a cluster runs on one machine: `torchrun --nnodes MIN:MAX --rdzv-backend c10d
--rdzv-endpoint 127.0.0.1:PORT --max-restarts N -m shardkit.train ...` with its own node-local cache
directory, its own S3 User-Agent (so the store can tell the nodes' requests apart) and its own log. The
agents rendezvous on loopback; the first one started hosts the c10d store (as the first node of a
Slurm or Kubernetes job would). `kill()` SIGKILLs the node's whole process tree, agent and workers, as a
lost machine would: torchrun starts its workers in sessions of their own, so killing the agent's
process group alone would leave them running.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from conftest import free_port
from conftest_warm import cold_environment
from process_tree import descendants, signal_all

# torch >= 2.4 shares the rendezvous TCPStore with the workers and caches the round-0 master address:
# a node that returns later waits for a MASTER_ADDR no one publishes in the new round and gives up
# (the scale-up failure of issue 26). Every agent of an elastic job must run with this set.
ELASTIC_AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


class Node:
    """One simulated node: a torchrun elastic agent and its workers, started with `start()`."""

    def __init__(self, name: str, *, workdir: Path, rdzv_port: int, train_args: list[str],
                 storage_options: dict | None = None, nnodes: str = "1:2", nproc: int = 1,
                 max_restarts: int = 3, env: dict[str, str] | None = None):
        self.name = name
        self.workdir = workdir
        self.cache_dir = workdir / f"cache-{name}"
        self.log_path = workdir / f"node-{name}.log"
        self.rdzv_port = rdzv_port
        self.train_args = train_args
        self.storage_options = storage_options
        self.nnodes = nnodes
        self.nproc = nproc
        self.max_restarts = max_restarts
        self.env = {**ELASTIC_AGENT_ENV, **(env or {})}
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def command(self) -> list[str]:
        options = []
        if self.storage_options is not None:
            config = dict(self.storage_options.get("config_kwargs") or {}, user_agent_extra=f"elastic-node-{self.name}")
            options = ["--storage-options", json.dumps(dict(self.storage_options, config_kwargs=config))]
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", self.nnodes,
                "--nproc_per_node", str(self.nproc), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{self.rdzv_port}", "--rdzv-id", "elastic-test",
                # A short last call: the test's agents are all up when a round opens.
                "--rdzv-conf", "last_call_timeout=1,join_timeout=120",
                "--max-restarts", str(self.max_restarts), "--monitor-interval", "0.2",
                "-m", "shardkit.train", *self.train_args, "--cache-dir", str(self.cache_dir), *options]

    def start(self) -> None:
        # cold unless the test asks for warm start: a node's loss must take its own agent's server with it
        env = {**cold_environment(os.environ), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **self.env}
        self.starts += 1
        log = open(self.log_path, "a")
        log.write(f"\n===== start {self.starts} at {time.time():.3f}\n")
        log.flush()
        self.process = subprocess.Popen(self.command(), env=env, stdout=log, stderr=subprocess.STDOUT,
                                        cwd=self.workdir, start_new_session=True)
        log.close()

    def kill(self) -> float:
        """SIGKILL the agent and every worker at once, as a lost machine; returns the time it happened."""
        assert self.process is not None
        signal_all([self.process.pid, *descendants(self.process.pid)], signal.SIGKILL)
        killed_at = time.time()
        self.process.wait(timeout=30)
        return killed_at

    def wait(self, timeout: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout)

    def stop(self) -> None:
        """Test clean-up: kill whatever is left of the node."""
        if self.process is not None and self.process.poll() is None:
            self.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def store_listening(port: int) -> bool:
    """Whether the rendezvous store accepts connections on 127.0.0.1:`port` (the first agent is up)."""
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def metric_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # the line being written right now
            pass
    return records


def last_step(run_dir: Path) -> int:
    steps = [r["step"] for r in metric_records(run_dir) if "loss" in r]
    return max(steps, default=0)


RESHARD = re.compile(r"was saved by (\d+) ranks, now (\d+)")


def world_changes(log: str) -> list[tuple[int, int]]:
    """(saved world size, new world size) of every resharded resume a node's log reports."""
    return [(int(a), int(b)) for a, b in RESHARD.findall(log)]


def wait_for(condition: Callable[[], bool], *, timeout: float, what: str, nodes: list[Node]) -> float:
    """Poll `condition` until it holds; on time-out fail with every node's log tail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return time.time()
        time.sleep(0.1)
    tails = "\n".join(f"--- node {n.name}:\n{n.log()[-4000:]}" for n in nodes)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{tails}")


def lose_and_return(workdir: Path, *, data: str, storage_options: dict | None, steps: int, batch_size: int,
                    checkpoint_every: int, timeout: float = 180) -> dict:
    """The elastic scenario on two nodes: train on both, SIGKILL node b's tree mid-epoch (between
    checkpoints), let node a re-form alone, start node b again and let the job scale back up and finish.

    Returns the nodes, the run directory and the wall-clock times of the kill and of node b's return.
    """
    run_dir = workdir / "run"
    train_args = ["--data", data, "--steps", str(steps), "--batch-size", str(batch_size), "--warmup-steps", "2",
                  "--checkpoint-every", str(checkpoint_every), "--keep", "3", "--log-sample-ids",
                  "--log-every", "50", "--device", "cpu", "--run-dir", str(run_dir), "--resume", "auto"]
    port = free_port()
    nodes = [Node(name, workdir=workdir, rdzv_port=port, train_args=train_args, storage_options=storage_options)
             for name in ("a", "b")]
    node_a, node_b = nodes
    logs = lambda: node_a.log() + node_b.log()  # noqa: E731 - rank 0 (either node) reports the reshards
    try:
        node_a.start()  # first: its agent hosts the c10d store, like the first node of a cluster job
        wait_for(lambda: store_listening(port), timeout=60, what="node a's agent to host the store", nodes=nodes)
        node_b.start()
        wait_for(lambda: last_step(run_dir) >= 2 * checkpoint_every + checkpoint_every // 2, timeout=timeout,
                 what="two-node training", nodes=nodes)
        if node_a.process.poll() is not None or node_b.process.poll() is not None:
            raise AssertionError("a node exited during two-node training:\n" + logs()[-4000:])
        killed_at = node_b.kill()
        wait_for(lambda: (2, 1) in world_changes(logs()), timeout=timeout,
                 what="node a to re-form alone and reshard 2 -> 1", nodes=nodes)
        alone_from = last_step(run_dir)
        wait_for(lambda: last_step(run_dir) >= alone_from + 5, timeout=timeout, what="training on one node",
                 nodes=nodes)
        if last_step(run_dir) >= steps - 50:
            raise AssertionError("the run is too short to show the scale-up: raise steps")
        returned_at = time.time()
        node_b.start()
        wait_for(lambda: (1, 2) in world_changes(logs()), timeout=timeout,
                 what="the returning node to join (reshard 1 -> 2)", nodes=nodes)
        codes = {node.name: node.wait(timeout=2 * timeout) for node in nodes}
        if any(codes.values()):
            raise AssertionError(f"exit codes {codes}:\n{logs()[-6000:]}")
    finally:
        for node in nodes:
            node.stop()
    return {"nodes": nodes, "run_dir": run_dir, "killed_at": killed_at, "returned_at": returned_at}
