"""The parts of a background save (`--async-save`) that leave the training loop's thread.

Measured in the loop (benchmarks/bench_goodput.py --save-cost), a background save's wall time was mostly waiting,
not work: for rank 0 to finish marking the previous checkpoint complete (a marker's fsync, a rename, a directory's
fsync, the pruning: 3-12 ms on this machine) and for DCP's hand-over thread to start; the work itself (the state
dicts, the copy into the staging buffers, DCP's hand-over) was ~2 ms of CPU. Two threads kept for the run take
them over:

- `SaveThread` takes a save from the state dicts on: the copy into the staging buffers, then the partial
  directory and the hand-over to DCP's writer. The parameters and the optimizer's state change only at the next
  optimizer step, so that step waits for the copy (`guard`: a step pre-hook on the optimizer) and the checkpoint
  holds exactly the saved step's state. What changes elsewhere is taken by the loop at the save: the loader's
  and RNG state, the scheduler's state, the optimizer's settings (`checkpoint_state.optimizer_settings`: the
  learning rate moves with the schedule also on steps without an update, --skip-steps and fp16 overflows).
- `Publications`: rank 0 marks each written checkpoint complete, in order; the loop hands it over and does not
  wait, the save thread waits for it before it removes stale partial directories.

Each is a `ThreadPoolExecutor` of one thread: the jobs run in order and a job's failure comes back through its
future (raised where the loop next waits for it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.staging import AsyncStager

Staged = TypeVar("Staged")


class SaveThread:
    """The thread that finishes background saves after the loop handed them over."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardkit-checkpoint-save")
        self._copied = threading.Event()
        self._copied.set()
        self._guarded: set[int] = set()

    def guard(self, optimizer: torch.optim.Optimizer) -> None:
        """Make `optimizer.step()` wait until the last save's copy is taken (once per optimizer)."""
        if id(optimizer) not in self._guarded:
            optimizer.register_step_pre_hook(self._wait_for_copy)
            self._guarded.add(id(optimizer))

    def _wait_for_copy(self, *_: Any) -> None:
        self._copied.wait()

    def submit(self, copy: Callable[[], Staged], hand_over: Callable[[Staged], Any]) -> SaveJob:
        """Run `copy()` then `hand_over(its result)` (DCP's future) in the thread. The guarded optimizer steps wait
        for `copy` (finished or failed: a failure comes back through the job)."""
        self._copied.clear()

        def job() -> Any:
            try:
                staged = copy()
            finally:
                self._copied.set()
            return hand_over(staged)

        try:
            return SaveJob(self._executor.submit(job))
        except BaseException:
            self._copied.set()
            raise


@dataclass(frozen=True)
class SaveJob:
    """A save the save thread finishes: `future` holds DCP's future once the state is handed over."""

    future: Future


def upload_of(pending: Any, *, block: bool) -> Future | None:
    """The future of a pending save's writing: `pending` is DCP's future, DCP's AsyncSaveResponse (custom stagers)
    or a `SaveJob` (None while its hand-over is not done, with `block` False; its failure is raised)."""
    if isinstance(pending, SaveJob):
        if not block and not pending.future.done():
            return None
        pending = pending.future.result()
    return pending if hasattr(pending, "result") else pending.upload_completion


class Publications:
    """Rank 0's thread that marks written checkpoints complete, in the order they were handed over."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._futures: list[Future] = []  # handed over, their failure not yet raised

    def submit(self, publish: Callable[[], None]) -> None:
        self.raise_failure()  # a failed publication is not overtaken silently
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardkit-checkpoint-publish")
        self._futures.append(self._executor.submit(publish))

    def settle(self) -> None:
        """Wait until the publications handed over are done, without raising their failure (the save thread's
        wait: the loop raises it)."""
        wait_for_futures(list(self._futures))

    def join(self) -> None:
        """Wait for the publications handed over, and raise the first failure among them, if any."""
        self.settle()
        self.raise_failure()

    def raise_failure(self) -> None:
        """Raise the first failure among the publications done; forget those done."""
        # One pass: a future that finished between two passes would be in neither list, its failure lost.
        done, running = [], []
        for future in self._futures:
            (done if future.done() else running).append(future)
        self._futures = running
        for future in done:
            future.result()


class AlreadyStaged(AsyncStager):
    """The stager for a state the save thread has already copied: DCP hands it to its writer as it is."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        """Nothing is staged here: nothing to wait for."""
