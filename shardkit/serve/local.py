"""The embedded service: a dispatcher in this process and N worker processes on this machine.

`python -m shardkit.serve.local --worker` is one worker process: it reads the data spec and the token from its
environment (neither appears on a command line) and ends when its parent does.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from shardkit.serve.data import DataSpec
from shardkit.serve.security import TOKEN_ENV, advertised_host, check_binding

logger = logging.getLogger(__name__)

SPEC_ENV = "SHARDKIT_SERVE_SPEC"
# How long a server's shutdown waits for its open streams: a consumer that stops reading (an iterator left open)
# holds its stream open under gRPC's flow control, and Flight's shutdown would wait for it forever.
SHUTDOWN_GRACE = 5.0


def stop_server(server: Any, grace: float = SHUTDOWN_GRACE) -> bool:
    """Shut a Flight server down, waiting at most `grace` seconds for its open streams; False when some were still
    open then (the server is left to end when their consumers read on or close: its threads hold no process open)."""
    closing = getattr(server, "closing", None)
    if closing is not None:
        closing.set()
    thread = threading.Thread(target=server.shutdown, daemon=True, name="shardkit-serve-shutdown")
    thread.start()
    thread.join(grace)
    if thread.is_alive():
        streams = getattr(server, "active_streams", "some")
        logger.warning("a service server still had %s open stream(s) %g s after its shutdown began (a consumer "
                       "stopped reading): left behind", streams, grace)
        return False
    return True


class LocalService:
    """A dispatcher on `host:port` (port 0: any free one) and `workers` worker processes serving `spec`; with
    `join` (a dispatcher's address), only the workers, joining that dispatcher; with `ray_address`, the workers
    are Ray actors on that cluster.

    Raises:
        ValueError: a non-loopback `host` without `token`.
    """

    def __init__(self, spec: DataSpec, *, workers: int, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, worker_threads: int = 0, join: str | None = None,
                 ray_address: str | None = None):
        from shardkit.serve.dispatcher import Dispatcher

        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"--workers must be an integer >= 0, got {workers!r}")
        check_binding(host, token)
        self.spec, self.host, self.token = spec, host, token
        # With `join`, this machine's workers join the dispatcher of another `shardkit serve` (several machines).
        self.dispatcher = None if join else Dispatcher(location=f"grpc://{host}:{port}", token=token)
        self.url = join or f"grpc://{advertised_host(host)}:{self.dispatcher.port}"
        self.processes: list[subprocess.Popen] = []
        self._threads: list[tuple[Any, threading.Event]] = []
        self.ray_workers: list[Any] = []
        if ray_address is not None:  # the workers are Ray actors on that cluster (shardkit.serve.ray_workers)
            from shardkit.serve.ray_workers import start_ray_workers

            self.ray_workers = start_ray_workers(spec, address=ray_address, count=workers, dispatcher=self.url,
                                                 token=token, host=None if host in ("0.0.0.0", "::") else host)
            workers = 0
        for _ in range(workers):
            self.add_worker()
        for _ in range(worker_threads):
            self.add_worker_thread()

    def add_worker_thread(self) -> None:
        """One more worker served by this process (the same server as a worker process's: for tests and small
        single-machine jobs; it shares this process's interpreter lock)."""
        from shardkit.serve.dispatcher import run_heartbeats
        from shardkit.serve.worker import WorkerServer

        server = WorkerServer(self.spec, location=f"grpc://{self.host}:0", token=self.token)
        stop = threading.Event()
        threading.Thread(target=run_heartbeats, daemon=True, name="heartbeats",
                         kwargs=dict(server=server, dispatcher=self.url, token=self.token, stop=stop,
                                     advertised=f"grpc://{advertised_host(self.host)}:{server.port}")).start()
        self._threads.append((server, stop))

    def add_worker(self) -> subprocess.Popen:
        """Start one more worker process (it joins at its first heartbeat)."""
        env = {**os.environ, SPEC_ENV: self.spec.to_json(), "PYTHONUNBUFFERED": "1"}
        if self.token:
            env[TOKEN_ENV] = self.token
        process = subprocess.Popen([sys.executable, "-m", "shardkit.serve.local", "--worker", self.url, self.host],
                                   env=env)
        self.processes.append(process)
        return process

    def wait_for_workers(self, count: int, timeout: float = 120.0) -> None:
        """Raises: TimeoutError: fewer than `count` workers joined within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while len(self.dispatcher._list({})["workers"]) < count:
            dead = [p.pid for p in self.processes if p.poll() not in (None, -signal.SIGKILL)]
            if dead or time.monotonic() > deadline:
                raise TimeoutError(f"{count} service workers did not join within {timeout:g} s"
                                   + (f" (workers {dead} exited)" if dead else ""))
            time.sleep(0.1)

    def workers(self) -> list[dict[str, Any]]:
        """The live workers: id, location, pid, load."""
        return self.dispatcher._list({})["workers"]

    def close(self, grace: float = SHUTDOWN_GRACE) -> None:
        """Stop the workers and the dispatcher, within about `grace` seconds even where a consumer has left a
        stream open (it then sees a broken stream and no worker to continue on)."""
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=grace + 5)
            except subprocess.TimeoutExpired:
                process.kill()
        if self.ray_workers:
            import ray

            for worker in self.ray_workers:
                ray.kill(worker, no_restart=True)
        for server, stop in self._threads:
            stop.set()
            stop_server(server, grace)
        if self.dispatcher is not None:
            stop_server(self.dispatcher, grace)

    def __enter__(self) -> LocalService:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def worker_main(dispatcher: str, host: str) -> int:
    """One worker process: serve the spec of `$SHARDKIT_SERVE_SPEC` until the parent (or a signal) ends it."""
    from shardkit.serve.dispatcher import run_heartbeats
    from shardkit.serve.worker import WorkerServer

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    spec = DataSpec.from_json(os.environ[SPEC_ENV])
    token = os.environ.get(TOKEN_ENV) or None
    server = WorkerServer(spec, location=f"grpc://{host}:0", token=token)
    stop = threading.Event()
    advertised = f"grpc://{advertised_host(host)}:{server.port}"
    threading.Thread(target=run_heartbeats, daemon=True, name="heartbeats",
                     kwargs=dict(server=server, dispatcher=dispatcher, advertised=advertised, token=token,
                                 stop=stop)).start()
    parent = os.getppid()

    def watch_parent() -> None:  # an orphaned worker would serve forever
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch_parent, daemon=True, name="parent-watch").start()
    # The handler must not block (it runs on the serving thread): the shutdown runs beside, and the process ends
    # after the grace even where a consumer left a stream open.
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(
        target=lambda: stop_server(server) or os._exit(0), daemon=True).start())
    server.serve()
    stop.set()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"] and len(sys.argv) == 4:
        sys.exit(worker_main(sys.argv[2], sys.argv[3]))
    print("usage: python -m shardkit.serve.local --worker DISPATCHER_URL HOST (started by shardkit serve)",
          file=sys.stderr)
    sys.exit(2)
