"""A node's warm-start fork server: imports the trainer once, then forks each restarted worker from itself.

    python -m shardkit.train.warm_server SOCKET AGENT_PID      (started by `shardkit.train.warm`, not by hand)

It binds its socket first (a launcher that connects while it imports waits in the backlog instead of starting a
second server; an exclusive lock on SOCKET.lock keeps one server per socket), then imports what a worker needs
before its first step (torch, torch.distributed, DCP, the dynamo that torch.optim imports, the trainer) and waits.
Nothing it does may spoil a fork: it starts no thread, runs no tensor operation (ATen's thread pool is made by
the child, after the fork, with the child's OMP_NUM_THREADS) and touches no accelerator. A fork leaves the server
as it was, so every later restart is as warm as the first.

It lives as long as its agent (a pidfd on the agent's pid: a lost node or the job's end closes it, and it kills
the workers it forked that still run), or until it has had no worker for the idle timeout. A node-wide server
(`SHARDKIT_WARM_START_SOCKET`, agent pid 0) serves every job and lives until the idle timeout.
"""

from __future__ import annotations

import fcntl
import gc
import json
import os
import selectors
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from shardkit.train.warm import FORKED_VARIABLE, HEADER, NO_AGENT, idle_timeout, installation

# What a worker imports before its first step, from `python -X importtime -m shardkit.train` (docs/GOODPUT.md).
WARM_MODULES = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
                "torch._dynamo", "torch.nn.parallel", "shardkit.train.__main__", "shardkit.train.loop")

REQUEST_TIMEOUT_S = 10.0  # a launcher sends its request as soon as it connects


@dataclass(frozen=True, kw_only=True)
class Request:
    """What a launcher hands the server: the worker's argv, environment, working directory and stdio."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    stdio: list[int]


def receive_request(conn: socket.socket) -> Request:
    """Read a launcher's request: a header with its stdio descriptors, then the JSON body (never a pickle)."""
    header, fds, _flags, _addr = socket.recv_fds(conn, HEADER.size, 3)
    if len(header) != HEADER.size or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ConnectionError("a warm-start request came without its header and three stdio descriptors")
    (length,), body = HEADER.unpack(header), b""
    while len(body) < length:
        chunk = conn.recv(length - len(body))
        if not chunk:
            raise ConnectionError("a warm-start request ended before its body")
        body += chunk
    fields = json.loads(body)
    if fields.get("installation") != installation():
        for fd in fds:
            os.close(fd)
        raise ValueError(f"it runs {_described(installation())}, the worker {_described(fields.get('installation'))}")
    return Request(argv=list(fields["argv"]), env=dict(fields["env"]), cwd=str(fields["cwd"]), stdio=fds)


def _described(runs: object) -> str:
    """An `installation()` as a refusal names it: "INTERPRETER with shardkit from PATH"."""
    if isinstance(runs, list) and len(runs) == 2:
        return f"{runs[0]} with shardkit from {runs[1]}"
    return f"an unknown installation ({runs!r})"


def become_worker(request: Request, conn: socket.socket, server_pid: int, forked_at: float) -> None:
    """In the forked child: take the launcher's stdio, environment and directory, in a session of its own."""
    os.setsid()  # the launcher relays the agent's signals to this group: the worker and what it starts
    for target, fd in enumerate(request.stdio):
        os.dup2(fd, target)
        os.close(fd)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    os.environ[FORKED_VARIABLE] = str(server_pid)
    sys.argv = [sys.argv[0], *request.argv]
    # sys.std* were /dev/null's in the server: reopen them on the launcher's descriptors.
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    threading.Thread(target=die_with_launcher, args=(conn,), daemon=True, name="warm-start-launcher").start()
    print(f"warm start: rank {request.env.get('RANK', '0')} forked from the warm-start server (pid {server_pid}) "
          f"as pid {os.getpid()} in {time.monotonic() - forked_at:.3f}s", file=sys.stderr, flush=True)


def die_with_launcher(conn: socket.socket) -> None:
    """The launcher stands for this worker to its agent: when it is gone (killed with its node, or by the
    agent after its stop signal was ignored), so is the worker's whole group."""
    try:
        while conn.recv(1):
            pass
    except OSError:
        pass
    os.killpg(0, signal.SIGKILL)


def run_worker(request: Request) -> int:
    """The trainer in the forked child; ATen's threads sized now, from the worker's environment."""
    import torch

    from shardkit.train.__main__ import run_trainer

    threads = request.env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    return run_trainer(request.argv)


class Server:
    """The accept loop: each request forks a worker; each worker's exit is sent to its launcher."""

    def __init__(self, listener: socket.socket, agent_pid: int, idle_s: float):
        self.listener = listener
        self.idle_s = idle_s
        self.pid = os.getpid()
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, "accept")
        if agent_pid != NO_AGENT:
            self.selector.register(os.pidfd_open(agent_pid), selectors.EVENT_READ, "agent")
        self.workers: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, launcher's connection)

    def serve(self) -> tuple[Request, socket.socket, float] | None:
        """Serve until the agent exits or the idle timeout; returns (in a forked child only) its request."""
        idle_since = time.monotonic()
        while True:
            timeout = None if self.workers else max(0.0, idle_since + self.idle_s - time.monotonic())
            events = self.selector.select(timeout)
            if not events and not self.workers:
                print(f"warm-start server {self.pid}: no worker for {self.idle_s:g}s, exiting", file=sys.stderr)
                return None
            for key, _ in events:
                if key.data == "agent":
                    self.kill_workers()
                    return None
                if key.data == "accept":
                    forked = self.fork_worker()
                    if forked is not None:  # this is the child
                        return forked
                else:
                    self.report_exit(key.fd)
            if not self.workers:
                idle_since = time.monotonic()

    def fork_worker(self) -> tuple[Request, socket.socket, float] | None:
        conn, _ = self.listener.accept()
        conn.settimeout(REQUEST_TIMEOUT_S)  # a client that connects and says nothing must not stall the node
        try:
            request = receive_request(conn)
            conn.settimeout(None)
        except (ConnectionError, OSError, ValueError, KeyError, TypeError) as err:
            with conn:
                try:
                    conn.sendall((json.dumps({"error": str(err)}) + "\n").encode())
                except OSError:  # the launcher is gone: nothing to answer
                    pass
            return None
        forked_at = time.monotonic()
        pid = os.fork()
        if pid == 0:
            self.close_in_child(conn)
            return request, conn, forked_at
        for fd in request.stdio:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.workers[pidfd] = (pid, conn)
        self.selector.register(pidfd, selectors.EVENT_READ, "worker")
        try:
            conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
        except OSError:  # the launcher was stopped while it waited in the backlog: so is its worker
            os.kill(pid, signal.SIGKILL)  # (reaped as any worker's exit, its report dropped)
        return None

    def close_in_child(self, conn: socket.socket) -> None:
        """The child keeps its own connection (to notice its launcher's death) and nothing else of the server."""
        for key in list(self.selector.get_map().values()):
            if key.fileobj is not self.listener:
                os.close(key.fd)
        self.selector.close()
        self.listener.close()
        for _pid, other in self.workers.values():
            if other is not conn:
                other.close()

    def report_exit(self, pidfd: int) -> None:
        pid, conn = self.workers.pop(pidfd)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        with conn:
            try:
                conn.sendall((json.dumps({"exit": os.waitstatus_to_exitcode(status)}) + "\n").encode())
            except OSError:  # the launcher is gone already
                pass

    def kill_workers(self) -> None:
        """The agent is gone (its node lost, or the job over): so are the workers it started through us."""
        for pidfd, (pid, conn) in self.workers.items():
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            os.close(pidfd)
            conn.close()


def bind(path: Path) -> tuple[socket.socket, int] | None:
    """The server's socket and lock, or None when another server holds the lock (it serves this agent)."""
    lock = os.open(f"{path}.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        return None
    path.unlink(missing_ok=True)  # a server killed with its node leaves its socket file
    remove_stale(path.parent)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(64)
    return listener, lock


def remove_stale(directory: Path) -> None:
    """Remove the socket and lock files that servers of agents now gone left (one killed with its node has
    no chance to): those whose agent pid is no process and whose lock nobody holds."""
    for lock_path in directory.glob("agent-*.sock.lock"):
        agent_pid = int(lock_path.name.split("-")[1].split(".")[0])
        if Path(f"/proc/{agent_pid}").exists():
            continue
        try:
            lock = os.open(lock_path, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            Path(str(lock_path).removesuffix(".lock")).unlink(missing_ok=True)
            lock_path.unlink(missing_ok=True)
        except BlockingIOError:
            pass
        finally:
            os.close(lock)


def warm_up() -> float:
    """Import what a worker needs; freeze the objects so that the children's reference counting does not
    copy the server's pages. Returns the seconds it took."""
    import importlib

    started = time.monotonic()
    for name in WARM_MODULES:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()
    return time.monotonic() - started


def main(argv: list[str]) -> int:
    path, agent_pid = Path(argv[0]), int(argv[1])
    bound = bind(path)
    if bound is None:
        return 0
    listener, lock = bound
    try:
        server = Server(listener, agent_pid, idle_timeout())
    except ProcessLookupError:  # the agent exited before we started
        path.unlink(missing_ok=True)
        return 0
    took = warm_up()
    serves = "every job on this node" if agent_pid == NO_AGENT else f"agent {agent_pid}"
    print(f"warm-start server {server.pid} for {serves}: ready in {took:.1f}s", file=sys.stderr, flush=True)
    forked = server.serve()
    if forked is None:
        path.unlink(missing_ok=True)
        return 0
    request, conn, forked_at = forked  # from here on this process is the worker
    os.close(lock)  # the lock is the server's: a worker that outlives it must not keep a new one from starting
    become_worker(request, conn, server.pid, forked_at)
    return run_worker(request)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
