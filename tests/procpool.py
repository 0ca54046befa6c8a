"""A small pool of long-lived spawned processes for multi-process tests.

Starting a process that imports torch costs seconds on a 2-core machine, so the loader tests start
a few once per session and send them tasks: process i starts when a task first needs it (most tests need 2
to 4 of the 8, and each xdist worker has a pool of its own: 2.5 CPU-seconds a process not started). Unlike
multiprocessing.Pool, the processes are not daemonic (DataLoader workers can start inside them) and each task
goes to a chosen process, so a group of tasks that rendezvous with each other (gloo) always runs concurrently.

A task that does not finish in time is a hang worth diagnosing, and it must not take the next test
with it: the pool dumps the Python stacks of every thread of the stuck processes and of their
children (DataLoader workers), puts them in the TimeoutError, and replaces those processes.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue
import signal
import tempfile
import time
import traceback

from process_tree import descendants, signal_all

READY = 0  # the serial of the message a process sends once it has started (tasks count from 1)
# faulthandler writes every thread's stack here when the process (or a child it forked) gets SIGUSR1.
_DUMP_SIGNAL = signal.SIGUSR1


def _serve(index: int, tasks, results, parent: int, dump_path: str) -> None:
    import faulthandler

    dump = open(dump_path, "a", buffering=1)  # noqa: SIM115 - open for the process's life
    faulthandler.register(_DUMP_SIGNAL, file=dump, all_threads=True)  # inherited by forked children

    import torch  # noqa: F401 - pay the import once, at start-up, in parallel

    results.put((index, READY, True, None))

    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return  # the test session died: do not linger
            continue
        if task is None:
            return
        serial, fn, kwargs = task
        try:
            results.put((index, serial, True, fn(**kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the test
            results.put((index, serial, False, traceback.format_exc()))
        # What a task left in reference cycles (a DataLoader iterator and its workers) goes now, not during
        # a later task, inside whatever that one is doing.
        gc.collect()


class ProcessPool:
    def __init__(self, size: int):
        self._ctx = mp.get_context("spawn")
        self._dumps = tempfile.mkdtemp(prefix="shardkit-pool-stacks-")
        self.results = self._ctx.Queue()
        self.tasks: list = [None] * size
        self.procs: list = [None] * size
        self._serial = 0

    def _dump_path(self, index: int) -> str:
        return os.path.join(self._dumps, f"pool-{index}.txt")

    def _start(self, index: int) -> None:
        self.tasks[index] = self._ctx.Queue()
        open(self._dump_path(index), "w").close()
        self.procs[index] = self._ctx.Process(
            target=_serve, args=(index, self.tasks[index], self.results, os.getpid(), self._dump_path(index)),
            daemon=False, name=f"test-pool-{index}")
        self.procs[index].start()

    def run(self, fn, kwargs_list: list[dict], timeout: float = 120.0) -> list:
        """Run fn(**kwargs_list[i]) on process i, all at once; return the results in order."""
        if len(kwargs_list) > len(self.procs):
            raise ValueError(f"{len(kwargs_list)} tasks for a pool of {len(self.procs)}")
        self._start_missing(len(kwargs_list), timeout)
        self._serial += 1
        serial = self._serial
        for i, kwargs in enumerate(kwargs_list):
            self.tasks[i].put((serial, fn, kwargs))
        results: dict[int, object] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(failures) < len(kwargs_list):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                waiting = [i for i in range(len(kwargs_list)) if i not in results and i not in failures]
                raise TimeoutError(f"pool tasks did not finish within {timeout}s: processes {waiting} still running"
                                   f"{self._failures_text(failures)}\n{self._replace(waiting)}")
            try:
                index, task_serial, ok, value = self.results.get(timeout=min(remaining, 5.0))
            except queue.Empty:
                dead = [p.name for p in self.procs if p is not None and not p.is_alive()]
                if dead:
                    for i, proc in enumerate(self.procs):
                        if proc is not None and not proc.is_alive():
                            self._start(i)
                    raise RuntimeError(f"pool processes died (started again): {dead}") from None
                continue
            if task_serial != serial:
                continue  # the late answer of a task whose run timed out (its process was replaced)
            if ok:
                results[index] = value
            else:
                failures[index] = value
        if failures:
            raise RuntimeError(self._failures_text(failures))
        return [results[i] for i in range(len(kwargs_list))]

    def _start_missing(self, count: int, timeout: float) -> None:
        """Start processes 0..count-1 where none runs yet and wait until each has imported torch, so that the
        tasks then sent begin together, as they would on processes started long before (a test of 8 processes
        contending for a cache must not see them start one by one as their imports finish)."""
        starting = {i for i in range(count) if self.procs[i] is None}
        for i in starting:
            self._start(i)
        deadline = time.monotonic() + timeout
        while starting:
            try:
                index, serial, _, _ = self.results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"pool processes {sorted(starting)} did not start within {timeout}s") from None
            if serial == READY:
                starting.discard(index)

    @staticmethod
    def _failures_text(failures: dict[int, str]) -> str:
        return "".join(f"\nprocess {i} failed:\n{text}" for i, text in sorted(failures.items()))

    def _replace(self, indices: list[int]) -> str:
        """Dump the stacks of pool processes `indices` and their children, kill them all, start them again;
        returns the stacks."""
        trees = {i: [self.procs[i].pid, *descendants(self.procs[i].pid)] for i in indices}
        for pids in trees.values():
            signal_all(pids, _DUMP_SIGNAL)
        time.sleep(2.0)  # faulthandler writes from the signal handler; give every process a moment
        report = []
        for i, pids in trees.items():
            with open(self._dump_path(i)) as f:
                report.append(f"--- stacks of pool process {i} (pids {pids}) ---\n{f.read()}")
            signal_all(pids, signal.SIGKILL)
            self.procs[i].join(10)
            self._start(i)
        return "\n".join(report)

    def close(self) -> None:
        started = [i for i, proc in enumerate(self.procs) if proc is not None]
        for i in started:
            self.tasks[i].put(None)
        for i in started:
            self.procs[i].join(10)
            if self.procs[i].is_alive():
                self.procs[i].kill()
