"""Executors: run `tokenize_unit` over work units in parallel and return results in unit order.

Both executors keep a bounded window of units in flight (memory stays flat however large the
corpus) and yield results strictly in submission order, so what the parent packs never depends on
which worker finished first.

- `LocalExecutor`: a pool of worker processes on this machine. They are forked when the parent is
  still single-threaded (they then start at once and inherit the loaded tokenizer), and spawned
  otherwise (forking a process that holds threads, e.g. fsspec's event loop, is unsafe).
- `ThreadExecutor`: threads of this process, for work that releases the GIL (a ranged read and numpy
  checks, as `shardkit convert` reads most formats): a result reaches the parent without being pickled
  and piped, and no worker process starts.
- `RayExecutor`: Ray tasks on a cluster (`address`), or on a local instance it starts.
"""

from __future__ import annotations

import logging
import socket
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from shardkit.process_info import available_cores

logger = logging.getLogger(__name__)

EXECUTORS = ("local", "ray")


def _ordered(submit: Callable[[Any], Any], wait: Callable[[Any], Any], items: Iterable[Any],
             window: int) -> Iterator[Any]:
    pending: deque = deque()
    iterator = iter(items)
    exhausted = False
    while True:
        while not exhausted and len(pending) < window:
            try:
                item = next(iterator)
            except StopIteration:
                exhausted = True
                break
            pending.append(submit(item))
        if not pending:
            return
        yield wait(pending.popleft())


class _PoolExecutor:
    """A `concurrent.futures` pool on this machine (`_start` makes it); results in submission order."""

    forks = False

    def __init__(self, workers: int, *, window: int | None = None):
        if workers < 1:
            raise ValueError(f"--workers must be >= 1, got {workers}")
        self.workers = workers
        self.window = window or 2 * workers + 1
        self._pool = None
        self.units_per_node: dict[str, int] = {}  # the build report's "nodes": here, this host

    def _start(self):
        raise NotImplementedError

    def __enter__(self):
        self._pool = self._start()
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def map_ordered(self, fn: Callable, items: Iterable[Any], *args: Any) -> Iterator[Any]:
        """`fn(item, *args)` for each item, in parallel, yielded in item order."""
        if self._pool is None:
            raise ValueError(f"{type(self).__name__} must be used as a context manager")
        pool, host = self._pool, socket.gethostname()

        def result(future):
            value = future.result()
            self.units_per_node[host] = self.units_per_node.get(host, 0) + 1
            return value

        return _ordered(lambda item: pool.submit(fn, item, *args), result, items, self.window)


class LocalExecutor(_PoolExecutor):
    """Worker processes on this machine.

    Args:
        workers: number of processes.
        window: units in flight (default: 2 per worker, so no worker waits for the parent).
    """

    def __init__(self, workers: int, *, window: int | None = None, initializer: Callable | None = None,
                 initargs: tuple = ()):
        super().__init__(workers, window=window)
        self.initializer = initializer
        self.initargs = initargs
        import multiprocessing
        import threading

        self.start_method = ("fork" if "fork" in multiprocessing.get_all_start_methods()
                             and threading.active_count() == 1 else "spawn")

    @property
    def forks(self) -> bool:
        """Whether workers are forked (and so inherit what the parent loaded before entering)."""
        return self.start_method == "fork"

    def _start(self):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        context = multiprocessing.get_context(self.start_method)
        pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=context, initializer=self.initializer,
                                   initargs=self.initargs)
        # Start every worker now (they load the tokenizer in the initializer) while the parent sets up.
        for _ in range(self.workers):
            pool.submit(int)
        return pool


class ThreadExecutor(_PoolExecutor):
    """Worker threads in this process, for work that releases the GIL (else they take turns).

    Args:
        workers: number of threads.
        window: units in flight (default: 2 per worker).
    """

    def _start(self):
        from concurrent.futures import ThreadPoolExecutor

        return ThreadPoolExecutor(self.workers, thread_name_prefix="unit-worker")


class RayExecutor:
    """Ray tasks; connects to `address` or starts a local Ray instance.

    Args:
        workers: tasks in flight at once (and CPUs of a local instance it starts).
        address: Ray cluster address ("auto", "ray://host:10001", ...); None starts a local instance.
    """

    def __init__(self, workers: int, *, address: str | None = None, window: int | None = None):
        if workers < 1:
            raise ValueError(f"--workers must be >= 1, got {workers}")
        self.workers = workers
        self.address = address
        self.window = window or 2 * workers + 1
        self._started = False
        self.forks = False
        # Units whose result was consumed, by the node that computed it (the build report's "nodes").
        self.units_per_node: dict[str, int] = {}

    def __enter__(self) -> RayExecutor:
        try:
            import ray
        except ImportError as err:
            raise ValueError("--executor ray needs the 'ray' package (pip install 'shardkit[ray]')") from err
        if not ray.is_initialized():
            if self.address:
                ray.init(address=self.address, include_dashboard=False, log_to_driver=False)
            else:
                # address="local": start our own instance, as documented, even where a Ray cluster already
                # runs on this machine (ray.init would otherwise join it and refuse num_cpus).
                ray.init(address="local", num_cpus=self.workers, include_dashboard=False, log_to_driver=False)
            self._started = True
        return self

    def __exit__(self, *exc) -> None:
        if self._started:
            import ray
            ray.shutdown()
            self._started = False

    def map_ordered(self, fn: Callable, items: Iterable[Any], *args: Any) -> Iterator[Any]:
        """`fn(item, *args)` as Ray tasks, yielded in item order. A task whose node dies is run again
        elsewhere (`max_retries`); only the result of its last run is consumed, so a unit counts once."""
        import ray

        remote = ray.remote(num_cpus=1, max_retries=3)(_on_node)
        shared = [ray.put(a) for a in args]

        def result(ref):
            node, value = ray.get(ref)
            self.units_per_node[node] = self.units_per_node.get(node, 0) + 1
            return value

        return _ordered(lambda item: remote.remote(fn, item, *shared), result, items, self.window)


def _on_node(fn: Callable, item: Any, *args: Any) -> tuple[str, Any]:
    """Run `fn(item, *args)` in a Ray task and say where: "ADDRESS/NODE-ID" (the id's first 8 hex digits,
    since several nodes may share an address)."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    return f"{ray.util.get_node_ip_address()}/{node[:8]}", fn(item, *args)


def make_executor(kind: str, workers: int | None, *, ray_address: str | None = None,
                  initializer: Callable | None = None, initargs: tuple = (), extra_window: int = 0,
                  threads: bool = False):
    """`LocalExecutor` or `RayExecutor` for `--executor KIND` (workers default: available cores); with
    `threads`, "local" is a `ThreadExecutor` (for work that releases the GIL).

    `initializer(*initargs)` runs once in each local worker process (Ray tasks initialise lazily; threads
    need none: the parent answers Ctrl-C, and it loaded what they use).
    """
    count = workers if workers is not None else available_cores()
    window = 2 * count + 1 + extra_window
    if kind == "local" and threads:
        return ThreadExecutor(count, window=window)
    if kind == "local":
        return LocalExecutor(count, window=window, initializer=initializer, initargs=initargs)
    if kind == "ray":
        return RayExecutor(count, address=ray_address, window=window)
    raise ValueError(f"--executor must be one of {EXECUTORS}, got {kind!r}")
