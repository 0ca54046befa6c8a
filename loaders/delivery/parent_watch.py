"""A DataLoader worker ends when the process that started it is gone.

torch's worker loop notices a dead parent (it compares its parent pid between index requests) and returns,
but the process then waits, at exit, for its result queue's feeder thread to flush the batches already put.
Ours travel by value through the queue's pipe (no shared-memory tensors), and the pipe's read end is held
open by the worker itself and its siblings (inherited copies), so with the parent dead the pipe stays full
and the worker waits forever: parent pid 1, its memory and its pipes held (a `torchrun ... | grep` never
ended). So a worker that reads through shardkit ends itself with `os._exit`, which skips that flush (nobody
is left to read it):

- at once, on Linux, when the thread that forked it was its parent's main thread: the kernel sends it
  SIGKILL when that thread ends (`prctl(PR_SET_PDEATHSIG)`). The signal follows the forking thread, not the
  process, so it is not asked for a worker forked from another thread (a loader iterated in a thread that
  ends while its persistent workers serve the next epoch from another one);
- and within `POLL_SECONDS` anyway: a daemon thread compares the parent pid with the one it started with.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

from shardkit.forking import forked_from

POLL_SECONDS = 0.5
_PR_SET_PDEATHSIG = 1
_watching_in: int | None = None  # the process whose parent is watched (a fork of it watches again)


def watch_parent() -> None:
    """End this process (a DataLoader worker) as soon as its parent is gone; once per process."""
    global _watching_in
    if _watching_in == os.getpid():
        return
    _watching_in = os.getpid()
    origin = forked_from()
    parent = origin[0] if origin is not None else os.getppid()
    if origin is not None and origin[1]:
        _die_with_forking_thread()
    if os.getppid() != parent:  # gone before the watch began
        os._exit(1)
    threading.Thread(target=_watch, args=(parent,), name="shardkit-parent-watch", daemon=True).start()


def _die_with_forking_thread() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # the polling thread still ends the worker


def _watch(parent: int) -> None:
    while True:
        time.sleep(POLL_SECONDS)
        if os.getppid() != parent:
            os._exit(1)
