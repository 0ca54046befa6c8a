"""Closing what a reader left open: never inside the garbage collector, always before the interpreter's teardown.

Two places run a close at a moment nobody chose:

- A shard handle's `__del__` (`shardkit.loaders.cache.store.CachedShard`) runs wherever the collector finds the
  handle unreachable: possibly in a thread that holds a lock its close takes. The background completion of a
  shard reads its block index under the shard's lock, a collection there ran the close of a dropped handle of
  that shard, and the close waited for that same lock, in that same thread, forever. So `__del__` takes no
  lock: it hands the close to `closer`, which runs it in a thread of its own (`queue.SimpleQueue.put` is
  reentrant, made to be called from `__del__`).
- A reading generator left unfinished (a `break` out of the loop, an iterator kept in a global) is closed by
  the interpreter's teardown, after it emptied the modules its `finally` needs (`'NoneType' object has no
  attribute 'Empty'` from the thread pool's shutdown, `'NoneType' object is not callable` from a release),
  which prints "Exception ignored" at a user's clean exit. Generators made with `@closed_at_exit` that are
  still open at exit are closed by an `atexit` hook, while every module is whole.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable, Generator

from shardkit.forking import restart_after_fork

logger = logging.getLogger(__name__)

_open_generators: weakref.WeakSet = weakref.WeakSet()
_open_generators_lock = threading.Lock()  # generators start in any thread; the exit hook lists them


class Closer:
    """Runs, in a daemon thread of this process, the closes that `__del__` methods hand over.

    `later` and `pid` use nothing but this object's attributes, so a `__del__` may call them even during the
    interpreter's teardown (when module globals may already be None).
    """

    def __init__(self) -> None:
        self._after_fork()
        restart_after_fork(self)

    def _after_fork(self) -> None:
        """A process of its own: its own queue and thread (the parent's thread does not exist in a fork)."""
        self.pid = os.getpid()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._start_lock = threading.Lock()
        self._running_in: int | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start this process's closing thread, if not running (from ordinary code, never from `__del__`)."""
        if self._running_in == self.pid:
            return
        with self._start_lock:
            if self._running_in != self.pid:
                self._thread = threading.Thread(target=_run_closes, args=(self._queue,), name="shardkit-closer",
                                                daemon=True)
                self._thread.start()
                self._running_in = self.pid

    def later(self, close: Callable[..., None], *args) -> None:
        """Run `close(*args)` soon, in the closing thread. Takes no lock."""
        self._queue.put((close, args))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the closes handed over so far have run (False: not within `timeout`). From ordinary code
        only (`ShardCache.drain`): a close handed over just before must have started what it starts."""
        if self._running_in != self.pid or threading.current_thread() is self._thread:
            return True  # no closing thread in this process (nothing handed over runs yet), or we are it
        done = threading.Event()
        self._queue.put((done.set, ()))
        return done.wait(timeout)


def _run_closes(pending: queue.SimpleQueue) -> None:
    while True:
        close, args = pending.get()
        try:
            close(*args)
        except Exception as err:  # noqa: BLE001 - nobody waits for this close: say what failed, go on
            logger.warning("closing a dropped shard handle failed: %s", err)
        del close, args  # let the handle's parts go now, not at the next close


closer = Closer()


def closed_at_exit(generator_function: Callable[..., Generator]) -> Callable[..., Generator]:
    """Decorate a generator function whose `finally` lets go of resources: its generators still open when the
    interpreter exits are closed by an `atexit` hook, before the teardown (module docstring)."""

    @functools.wraps(generator_function)
    def start(*args, **kwargs) -> Generator:
        generator = generator_function(*args, **kwargs)
        with _open_generators_lock:
            _open_generators.add(generator)
        return generator

    return start


def _new_lock_in_child() -> None:
    global _open_generators_lock
    _open_generators_lock = threading.Lock()  # another thread may have held the parent's at the fork


os.register_at_fork(after_in_child=_new_lock_in_child)


@atexit.register
def _close_open_generators() -> None:
    with _open_generators_lock:
        generators = list(_open_generators)
    for generator in generators:
        try:
            generator.close()
        except Exception as err:  # noqa: BLE001 - e.g. one running in a daemon thread right now: leave it
            logger.debug("could not close %s at exit: %s", generator, err)
