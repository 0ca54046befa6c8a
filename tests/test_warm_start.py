"""Warm start (shardkit.train.warm): torchrun's restarted workers forked from the node's server.

The elastic job is the recipe of docs/PARALLELISM.md on two simulated nodes (plain torchrun, so the first
worker of each agent starts the server and runs cold). Node b's whole tree is SIGKILLed mid-epoch; node a's
agent re-forms alone and its new worker must be forked from the server (its log says so), the resume must be
exact (every step once, no sample id twice, none of the epoch's order skipped), node b's server must go with
its node and node a's with the job.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_port
from conftest_warm import cold_environment
from elastic_nodes import Node, last_step, metric_records, store_listening, wait_for, world_changes
from train_runs import sample_ids, write_byte_dataset

from shardkit.train import warm

SAMPLES, SEQ_LEN, PER_SHARD, BATCH, STEPS, EVERY = 1200, 32, 100, 4, 80, 10
FORKED = re.compile(r"warm start: rank 0 forked from the warm-start server \(pid (\d+)\)")
SERVER = re.compile(r"warm-start server (\d+) for agent (\d+): ready")


class QuickNode(Node):
    """A node whose agent declares a silent peer dead after 3 s (1 s x 3), not the default 15 s: the loss's
    rendezvous, which warm start does not change, would otherwise be most of the test's time."""

    def command(self) -> list[str]:
        command = super().command()
        at = command.index("--rdzv-conf") + 1
        command[at] += ",keep_alive_interval=1,keep_alive_max_attempt=3"
        return command


def servers_of(agent_pid: int) -> list[int]:
    """The pids of live warm-start servers serving the agent `agent_pid` (from their command lines)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"shardkit.train.warm_server" in args and str(agent_pid).encode() in args:
            found.append(int(cmdline.parent.name))
    return found


def gone(pids: list[int]) -> bool:
    """Whether none of `pids` is a live process (zombies count as gone)."""
    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False
    return not any(alive(pid) for pid in pids)


@pytest.mark.slow
def test_a_node_loss_restarts_the_survivor_forked_from_its_server_and_resumes_exactly(tmp_path):
    data = str(tmp_path / "data")
    write_byte_dataset(data, num_samples=SAMPLES, seq_len=SEQ_LEN, samples_per_shard=PER_SHARD)
    run_dir = tmp_path / "run"
    train_args = ["--data", data, "--steps", str(STEPS), "--batch-size", str(BATCH), "--warmup-steps", "2",
                  "--checkpoint-every", str(EVERY), "--keep", "3", "--log-sample-ids", "--log-every", "5",
                  "--device", "cpu", "--run-dir", str(run_dir), "--resume", "auto"]
    port = free_port()
    nodes = [QuickNode(name, workdir=tmp_path, rdzv_port=port, train_args=train_args, max_restarts=2,
                  env={warm.ENABLE_VARIABLE: "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}) for name in ("a", "b")]
    node_a, node_b = nodes
    try:
        node_a.start()
        wait_for(lambda: store_listening(port), timeout=60, what="node a's agent to host the store", nodes=nodes)
        node_b.start()
        wait_for(lambda: last_step(run_dir) >= EVERY + EVERY // 2, timeout=120, what="two-node training",
                 nodes=nodes)
        wait_for(lambda: servers_of(node_b.process.pid), timeout=60, what="node b's warm-start server", nodes=nodes)
        b_servers = servers_of(node_b.process.pid)
        forked_before = len(FORKED.findall(node_a.log()))
        node_b.kill()
        wait_for(lambda: gone(b_servers), timeout=10, what="node b's server to die with its node", nodes=nodes)
        wait_for(lambda: (2, 1) in world_changes(node_a.log()), timeout=120, what="node a to re-form alone",
                 nodes=nodes)
        assert node_a.wait(timeout=120) == 0, node_a.log()[-4000:]
        a_servers = [int(pid) for pid, agent in SERVER.findall(node_a.log()) if int(agent) == node_a.process.pid]
        assert len(a_servers) == 1, node_a.log()[-4000:]
        wait_for(lambda: gone(a_servers), timeout=10, what="node a's server to end with its agent", nodes=nodes)
    finally:
        for node in nodes:
            node.stop()
    # The first worker ran cold (it started the server); each restart (node b's joining, if it came after node
    # a's first round, and its loss) was forked from that server.
    forked = FORKED.findall(node_a.log())
    assert len(forked) == forked_before + 1 and set(forked) == {str(a_servers[0])}, node_a.log()[-4000:]
    assert sorted(r["step"] for r in metric_records(run_dir) if "loss" in r) == list(range(1, STEPS + 1))
    by_step = sample_ids(run_dir)
    ids = [i for step in sorted(by_step) for i in by_step[step]]
    assert sorted(by_step) == list(range(1, STEPS + 1)) and len(ids) == len(set(ids))
    from shardkit import StreamingDataLoader, StreamingDataset

    reference = iter(StreamingDataLoader(StreamingDataset(data, cache_dir=tmp_path / "cache-ref", num_partitions=2),
                                         batch_size=BATCH))
    expected: set[int] = set()
    while len(expected) < len(ids):
        expected.update(next(reference)["sample_id"].tolist())
    assert set(ids) == expected, "the resumed run skipped samples of the epoch's order"


@pytest.fixture
def node_server():
    """A warm-start server for workers this test process starts (it plays their agent: their parent)."""
    path = warm.socket_path(os.getpid())
    server = warm.start_server(path, os.getpid())
    deadline = time.monotonic() + 30
    while not path.exists() and time.monotonic() < deadline:  # bound before it imports
        time.sleep(0.05)
    yield server
    for pid in servers_of(os.getpid()):
        os.kill(pid, signal.SIGKILL)
    server.wait(timeout=30)


@pytest.mark.slow
def test_a_forked_worker_gets_the_agents_signals_and_its_exit_code_comes_back(node_server, tmp_path):
    env = {**cold_environment(os.environ), "TORCHELASTIC_RUN_ID": "test", warm.ENABLE_VARIABLE: "1",
           "OMP_NUM_THREADS": "1"}
    env.pop("MASTER_ADDR", None)
    # A user's mistake: the trainer's one-line error and its exit code 2 come back through the launcher.
    mistake = subprocess.run([sys.executable, "-m", "shardkit.train", "--data", str(tmp_path), "--no-such-option"],
                             env=env, capture_output=True, text=True, timeout=120)
    assert mistake.returncode == 2 and FORKED.search(mistake.stderr), mistake.stderr
    assert "--no-such-option" in mistake.stderr and "Traceback" not in mistake.stderr, mistake.stderr
    # The agent stops a worker with SIGTERM: relayed, the trainer saves and stops with 128 + 15, as unforked.
    data = str(tmp_path / "data")
    write_byte_dataset(data, num_samples=400, seq_len=SEQ_LEN, samples_per_shard=PER_SHARD)
    run_dir = tmp_path / "run"
    worker = subprocess.Popen([sys.executable, "-m", "shardkit.train", "--data", data, "--steps", "100000",
                               "--batch-size", "2", "--device", "cpu", "--run-dir", str(run_dir), "--log-every", "1",
                               "--checkpoint-every", "0", "--cache-dir", str(tmp_path / "cache")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while last_step(run_dir) < 3 and worker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        worker.send_signal(signal.SIGTERM)
        out, err = worker.communicate(timeout=60)
    finally:
        worker.kill()
    assert worker.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert FORKED.search(err) and re.search(r"stopped by a signal after step \d+; checkpoint saved", out), out + err
    # A worker killed by SIGKILL (a fault injected at step 2): the launcher dies of SIGKILL too, as the agent
    # would see an unforked worker die (its disposition cannot be set: re-raising it must not trip over that).
    killed = subprocess.run([sys.executable, "-m", "shardkit.train", "--data", data, "--steps", "5", "--batch-size", "2",
                             "--device", "cpu", "--run-dir", str(tmp_path / "killed"), "--cache-dir",
                             str(tmp_path / "cache")], env={**env, "SHARDKIT_FAULT_INJECT": "step:2"},
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL and FORKED.search(killed.stderr), killed.stderr[-3000:]


def test_warm_start_is_wanted_only_when_asked_under_torchrun_or_a_node_server_and_not_in_a_forked_worker():
    agent = {"TORCHELASTIC_RUN_ID": "job"}
    assert not warm.wanted(agent)  # without the flag nothing changes
    assert not warm.wanted({warm.ENABLE_VARIABLE: "1"})  # no agent: a plain `python -m shardkit.train`
    node = {warm.ENABLE_VARIABLE: "1", warm.SOCKET_VARIABLE: "/run/shardkit/trainer.sock"}
    assert warm.wanted(node) and not warm.wanted({**node, warm.ENABLE_VARIABLE: "0"})  # plain, with a node's server
    assert not warm.wanted({**node, warm.FORKED_VARIABLE: "123"})
    assert warm.wanted({**agent, warm.ENABLE_VARIABLE: "1"}) and warm.wanted({**agent, warm.ENABLE_VARIABLE: "yes"})
    assert not warm.wanted({**agent, warm.ENABLE_VARIABLE: "0"})
    assert not warm.wanted({**agent, warm.ENABLE_VARIABLE: "1", warm.FORKED_VARIABLE: "123"})


def test_a_bad_idle_timeout_is_one_line_naming_the_variable():
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "job", warm.ENABLE_VARIABLE: "1", warm.IDLE_VARIABLE: "soon"}
    result = subprocess.run([sys.executable, "-m", "shardkit.train", "--steps", "1"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and warm.IDLE_VARIABLE in lines[0] and "'soon'" in lines[0], result.stderr


@pytest.mark.slow
def test_a_node_wide_server_forks_every_later_trainer_plain_or_under_torchrun(tmp_path):
    """SHARDKIT_WARM_START_SOCKET: the first trainer started on the node finds no server, starts it and runs
    cold; every later one, of any job, plain `python -m shardkit.train` (one-rank `shardkit tune` trials) or
    torchrun's ranks, is forked from it. The server belongs to no agent: it outlives the jobs and writes its log
    next to its socket. A directory others may enter is refused in one line naming the variable."""
    data = str(tmp_path / "data")
    write_byte_dataset(data, num_samples=96, seq_len=SEQ_LEN, samples_per_shard=48)
    directory = tmp_path / "node"
    directory.mkdir(mode=0o700)
    socket_path = directory / "trainer.sock"
    env = {**cold_environment(os.environ), warm.ENABLE_VARIABLE: "1", warm.SOCKET_VARIABLE: str(socket_path),
           "OMP_NUM_THREADS": "1"}
    for key in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "RANK", "WORLD_SIZE"):
        env.pop(key, None)

    def train(name: str, launcher: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([*launcher, "-m", "shardkit.train", "--data", data, "--steps", "2", "--batch-size", "2",
                               "--device", "cpu", "--run-dir", str(tmp_path / name), "--cache-dir",
                               str(tmp_path / "cache")], env=env, capture_output=True, text=True, timeout=180)

    try:
        first = train("first", [sys.executable])
        assert first.returncode == 0 and not FORKED.search(first.stderr), first.stderr[-3000:]
        deadline = time.monotonic() + 120
        while "ready" not in (log := Path(f"{socket_path}.log")).read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "for every job on this node: ready" in log.read_text(), log.read_text()
        plain = train("plain", [sys.executable])
        assert plain.returncode == 0 and FORKED.search(plain.stderr), plain.stderr[-3000:]
        ranks = train("ranks", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"])
        assert ranks.returncode == 0, ranks.stderr[-3000:]
        assert re.findall(r"warm start: rank (\d) forked", ranks.stderr) in (["0", "1"], ["1", "0"]), ranks.stderr[-3000:]
        assert last_step(tmp_path / "ranks") == 2
        # A launcher of another installation (here another interpreter path) is refused and runs cold: a
        # node-wide server must never run its own shardkit for another virtual environment's job.
        other = tmp_path / "python3"
        other.symlink_to(sys.executable)
        elsewhere = train("elsewhere", [str(other)])
        assert elsewhere.returncode == 0 and not FORKED.search(elsewhere.stderr), elsewhere.stderr[-3000:]
        assert "starting cold" in elsewhere.stderr and f"the worker {other} with shardkit from " in elsewhere.stderr, \
            elsewhere.stderr[-3000:]
        assert f"it runs {sys.executable} with shardkit from " in elsewhere.stderr, elsewhere.stderr[-3000:]
        directory.chmod(0o755)
        refused = train("refused", [sys.executable])
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode == 2 and len(lines) == 1 and warm.SOCKET_VARIABLE in lines[0], refused.stderr
        env[warm.SOCKET_VARIABLE] = str(directory / ("x" * 120))
        too_long = train("too-long", [sys.executable])
        lines = too_long.stderr.strip().splitlines()
        assert too_long.returncode == 2 and len(lines) == 1 and "shorter than 108" in lines[0], too_long.stderr
    finally:
        for pid in servers_of(warm.NO_AGENT):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if str(socket_path).encode() in cmdline:
                os.kill(pid, signal.SIGKILL)
