"""Warm start: torchrun's restarted workers are forked from a node's server that has imported torch already.

    SHARDKIT_WARM_START=1 torchrun ... -m shardkit.train ...

When an elastic agent restarts its workers after a membership change, every new process pays the
interpreter's start and `import torch` again (8-11 s of a node loss's ~20 s on the machine of
docs/GOODPUT.md). With warm start the worker torchrun starts is this small launcher (it imports no torch): it
connects to its node's fork server over a Unix socket (`shardkit.train.warm_server`: torch, DCP, dynamo and the
trainer imported, waiting), hands it argv, environment and working directory as JSON and its stdin, stdout
and stderr as file descriptors (SCM_RIGHTS), and the server forks a child that becomes the worker. The launcher
relays the agent's signals to the child's process group and exits with the child's exit code (a signal's death
is re-raised), so the agent sees an ordinary worker; if the launcher dies, the child kills its group.

The server belongs to one agent: its socket is named after the launcher's parent (the agent's pid), it exits
when that agent exits (a node's loss or the job's end) or after `SHARDKIT_WARM_START_IDLE_S` seconds without a
worker (default 1800). `python -m shardkit.train.elastic` starts it with the agent, so that it imports while the
agent waits for its rendezvous; under plain torchrun the first worker of an agent finds no server, starts one
and runs cold itself (the first start costs no more than without warm start), and every restart is forked.
Measured, and what it costs: docs/GOODPUT.md ("Warm start").

One server for every job on a node: with `SHARDKIT_WARM_START_SOCKET=PATH` as well, every trainer started on the
node (under torchrun or as plain `python -m shardkit.train`, e.g. the one-rank trials of `shardkit tune`) is
forked from the server at PATH, the first worker of each job included: the first launcher finds none, starts it
and runs cold, every later one is forked. Such a server belongs to no agent: it exits after the idle timeout,
its output goes to PATH.log, and PATH's directory must be this user's own with mode 0700 (as the per-agent
sockets' directory is), because whoever can connect has code run as this user.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ENABLE_VARIABLE = "SHARDKIT_WARM_START"
FORKED_VARIABLE = "SHARDKIT_WARM_FORKED"  # set in a forked worker: the server's pid
SOCKET_VARIABLE = "SHARDKIT_WARM_START_SOCKET"  # one server for every job on the node, at this path
NO_AGENT = 0  # the agent pid given to a node-wide server: it serves every job, not one agent's
MAX_SOCKET_PATH = 108  # sun_path's size on Linux, its terminating NUL included
IDLE_VARIABLE = "SHARDKIT_WARM_START_IDLE_S"
DEFAULT_IDLE_S = 1800.0
# The length of the request's JSON, sent with the stdio descriptors: one native-order unsigned 64-bit integer.
HEADER = struct.Struct("=Q")
# What the agent sends its workers (SIGTERM to stop them, SIGINT/SIGHUP/SIGQUIT passed on to it), relayed.
RELAYED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def requested(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether `SHARDKIT_WARM_START` asks for warm start (1/true/yes)."""
    return environ.get(ENABLE_VARIABLE, "").strip().lower() in ("1", "true", "yes")


def wanted(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether this process should hand its work to a warm-start server: warm start is requested, torchrun's
    agent started it (a per-agent server serves one agent's restarts) or a node-wide server is named, and it
    is not a worker forked by a server."""
    return (requested(environ) and ("TORCHELASTIC_RUN_ID" in environ or bool(environ.get(SOCKET_VARIABLE)))
            and FORKED_VARIABLE not in environ)


def private_directory(directory: Path, variable: str) -> Path:
    """`directory`, which only this user may enter (so no other user can connect and have code run as this
    user); `variable` is the setting to change when it is not."""
    if directory.stat().st_uid != os.getuid() or directory.stat().st_mode & 0o077:
        raise OSError(f"{directory}: the warm-start socket directory must be this user's own with mode 0700; "
                      f"remove it or unset {variable}")
    return directory


def socket_path(agent_pid: int) -> Path:
    """The Unix socket of the server serving the workers of the agent with pid `agent_pid`."""
    directory = Path(tempfile.gettempdir()) / f"shardkit-warm-{os.getuid()}"
    directory.mkdir(mode=0o700, exist_ok=True)
    return private_directory(directory, ENABLE_VARIABLE) / f"agent-{agent_pid}.sock"


def server_address(environ: dict[str, str] | os._Environ = os.environ) -> tuple[Path, int]:
    """The socket this process's server listens on, and the agent it serves (`NO_AGENT` for a node-wide one)."""
    shared = environ.get(SOCKET_VARIABLE, "")
    if not shared:
        return socket_path(os.getppid()), os.getppid()
    path = Path(shared).absolute()
    if len(os.fsencode(path)) >= MAX_SOCKET_PATH:
        raise OSError(f"{SOCKET_VARIABLE}={shared}: a Unix socket's path must be shorter than {MAX_SOCKET_PATH} "
                      f"bytes; choose a shorter one")
    if not path.parent.is_dir():
        raise OSError(f"{SOCKET_VARIABLE}={shared}: its directory does not exist; create it with mode 0700")
    return private_directory(path.parent, SOCKET_VARIABLE) / path.name, NO_AGENT


def idle_timeout(environ: dict[str, str] | os._Environ = os.environ) -> float:
    """`SHARDKIT_WARM_START_IDLE_S` in seconds (a server with no worker for that long exits)."""
    text = environ.get(IDLE_VARIABLE, "")
    try:
        value = float(text) if text else DEFAULT_IDLE_S
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"{IDLE_VARIABLE}={text!r}: give the seconds a warm-start server waits without a worker "
                         f"before it exits, a number > 0 (default {DEFAULT_IDLE_S:g})")
    return value


def installation() -> list[str]:
    """The interpreter and the shardkit this process runs: a server forks workers only for launchers that run
    the same (a node-wide server may be reached from another virtual environment or checkout)."""
    return [sys.executable, str(Path(__file__).resolve().parents[1])]


def send_request(sock: socket.socket, argv: list[str]) -> None:
    """Hand the server this process's argv, environment, working directory and installation, and its stdio
    descriptors."""
    body = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(),
                       "installation": installation()}).encode()
    socket.send_fds(sock, [HEADER.pack(len(body))], [0, 1, 2])
    sock.sendall(body)


def start_server(path: Path, agent_pid: int) -> subprocess.Popen:
    """Start the node's server in a session of its own (the agent stops a worker by signalling the worker's
    process group; the server must outlive the worker). A per-agent server's output goes to this process's
    stderr (the agent's log); a node-wide one outlives the job that started it, so it writes to PATH.log (a
    job's stderr held open by it would never reach its end)."""
    command = [sys.executable, "-m", "shardkit.train.warm_server", str(path), str(agent_pid)]
    if agent_pid != NO_AGENT:
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(),
                                stderr=sys.stderr.fileno(), start_new_session=True, close_fds=True)
    with open(f"{path}.log", "ab") as log:
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                                close_fds=True)


def relay_signals(child_pid: int) -> None:
    """Pass the agent's signals to the forked worker's process group (as the agent would to a worker's)."""
    def relay(signum, _frame):
        try:
            os.killpg(child_pid, signum)
        except ProcessLookupError:  # not yet its group's leader (it calls setsid first thing), or gone
            try:
                os.kill(child_pid, signum)
            except ProcessLookupError:
                pass
    for signum in RELAYED_SIGNALS:
        signal.signal(signum, relay)


def wait_for_worker(sock: socket.socket) -> int:
    """Read the server's replies (one JSON line each: the child's pid, then its wait status's exit code)."""
    replies = sock.makefile("r", encoding="utf-8")
    first = replies.readline()
    if not first:
        raise ConnectionError("the warm-start server closed the connection before it forked a worker")
    reply = json.loads(first)
    if "error" in reply:
        raise ConnectionError(f"the warm-start server refused: {reply['error']}")
    relay_signals(reply["pid"])
    last = replies.readline()
    if not last:
        print(f"error: the warm-start server exited while worker {reply['pid']} ran; its exit code is unknown",
              file=sys.stderr)
        return 1
    return json.loads(last)["exit"]


def exit_like(code: int) -> None:
    """Exit with the worker's code; a worker killed by a signal is re-raised so the agent sees the same."""
    if code < 0:
        if -code != signal.SIGKILL:  # SIGKILL's disposition cannot be set (OSError), nor need be
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def launch(argv: list[str]) -> int | None:
    """Run the trainer with `argv` in a process forked from this node's server and return its exit code (a
    worker's death by a signal is re-raised). None: there is no server yet (one is started now) or it forked
    nothing, and the caller runs the trainer itself (cold)."""
    try:
        path, agent_pid = server_address()
        idle_timeout()  # a bad value is the user's to fix now, not the detached server's to report
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        start_server(path, agent_pid)
        return None
    with sock:
        send_request(sock, argv)
        try:
            code = wait_for_worker(sock)
        except ConnectionError as err:  # nothing was forked: this worker runs cold instead
            print(f"warning: {err}; starting cold", file=sys.stderr)
            return None
    exit_like(code)
    return code

