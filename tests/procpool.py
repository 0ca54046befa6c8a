"""A small pool of long-lived spawned processes for multi-process tests.

Starting a process that imports torch costs seconds on a 2-core machine, so the loader tests start
a few once per session and send them tasks. Unlike multiprocessing.Pool, the processes are not
daemonic (DataLoader workers can start inside them) and each task goes to a chosen process, so a
group of tasks that rendezvous with each other (gloo) always runs concurrently.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback


def _serve(index: int, tasks, results, parent: int) -> None:
    import torch  # noqa: F401 - pay the import once, at start-up, in parallel

    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return  # the test session died: do not linger
            continue
        if task is None:
            return
        fn, kwargs = task
        try:
            results.put((index, True, fn(**kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the test
            results.put((index, False, traceback.format_exc()))


class ProcessPool:
    def __init__(self, size: int):
        ctx = mp.get_context("spawn")
        self.tasks = [ctx.Queue() for _ in range(size)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_serve, args=(i, q, self.results, os.getpid()), daemon=False,
                                  name=f"test-pool-{i}") for i, q in enumerate(self.tasks)]
        for proc in self.procs:
            proc.start()

    def run(self, fn, kwargs_list: list[dict], timeout: float = 120.0) -> list:
        """Run fn(**kwargs_list[i]) on process i, all at once; return the results in order."""
        if len(kwargs_list) > len(self.procs):
            raise ValueError(f"{len(kwargs_list)} tasks for a pool of {len(self.procs)}")
        for i, kwargs in enumerate(kwargs_list):
            self.tasks[i].put((fn, kwargs))
        results: dict[int, object] = {}
        failures = []
        deadline = time.monotonic() + timeout
        while len(results) + len(failures) < len(kwargs_list):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"pool tasks did not finish within {timeout}s ({len(results)} done)")
            try:
                index, ok, value = self.results.get(timeout=min(remaining, 5.0))
            except queue.Empty:
                dead = [p.name for p in self.procs if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"pool processes died: {dead}") from None
                continue
            if ok:
                results[index] = value
            else:
                failures.append(f"process {index}:\n{value}")
        if failures:
            raise RuntimeError("\n".join(failures))
        return [results[i] for i in range(len(kwargs_list))]

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
