"""What a process forked from this one must not carry over.

A DataLoader forks its workers whatever the parent's other threads are doing at that instant. Three things
the child inherits are then broken:

- a lock another thread held (nothing in the child will release it);
- a thread pool (its threads do not exist in the child, but the pool counts them as idle, so work submitted
  there never runs);
- an `flock` another thread held. An flock belongs to the open file description, which the fork shares: the
  child holds the lock too, as long as it lives, though nothing in it knows (the parent's thread is not
  there), so the parent's release releases nothing and the child, like every process of the node, then
  waits for that lock forever. O_CLOEXEC is no help: a fork does not exec.

Each would hang the worker for good. An object owning such state registers here (`restart_after_fork`), and
in every child forked afterwards its `_after_fork()` runs right after the fork, while the child has one
thread, to make that state again (what unpickling in a spawned worker does). Lock files are opened as
`LockFile`s: a forked child closes its copies of them before anything else runs, and closing a `LockFile`
it inherited does nothing there.
"""

from __future__ import annotations

import fcntl
import os
import threading
import weakref

_restart_in_child: weakref.WeakSet = weakref.WeakSet()
# The descriptors of the `LockFile`s open in this process. Opening and closing one (never waiting for its
# lock) happen under `_descriptors_lock`, which a fork holds too, so a child's list is exact.
_descriptors: set[int] = set()
_descriptors_lock = threading.Lock()
# (pid, forked from its main thread) of the process this one was forked from (None: not forked by os.fork);
# `_forking`: the same for the fork under way, in the forking process.
_forked_from: tuple[int, bool] | None = None
_forking: tuple[int, bool] | None = None


def restart_after_fork(obj) -> None:
    """Call `obj._after_fork()` in each child forked from this process from now on (while `obj` lives)."""
    _restart_in_child.add(obj)


class LockFile:
    """A descriptor of lock file `path` (created if missing), for `flock`, that stays with this process.

    A child forked while it is open closes its copy at once (module docstring), so a lock held here is
    released by `close()` here, whatever was forked in between.
    """

    def __init__(self, path: str):
        with _descriptors_lock:
            self.fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            _descriptors.add(self.fd)
            self._pid = os.getpid()

    def lock(self, *, shared: bool = False, wait: bool = True) -> bool:
        """Take the file's flock (shared or exclusive); without `wait`, False when another holds it."""
        try:
            fcntl.flock(self.fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            return False
        return True

    def close(self) -> None:
        """Close the descriptor (which releases its lock), once; nothing in a process that inherited it
        (the fork closed its copy there)."""
        with _descriptors_lock:
            if self.fd is None or self._pid != os.getpid():
                return
            _descriptors.discard(self.fd)
            fd, self.fd = self.fd, None
            os.close(fd)


def forked_from() -> tuple[int, bool] | None:
    """(pid, whether its main thread forked) of the process this one was forked from by `os.fork`; None in a
    process started otherwise (spawned, or forked outside Python)."""
    return _forked_from


def _before_fork() -> None:
    global _forking
    _descriptors_lock.acquire()  # no LockFile opens or closes across the fork
    _forking = (os.getpid(), threading.current_thread() is threading.main_thread())


def _after_fork_in_parent() -> None:
    _descriptors_lock.release()


def _after_fork_in_child() -> None:
    global _descriptors_lock, _forked_from
    _forked_from = _forking
    for fd in _descriptors:  # the parent's: its threads hold or release those locks, not this process
        try:
            os.close(fd)
        except OSError:
            pass
    _descriptors.clear()
    _descriptors_lock = threading.Lock()
    for obj in list(_restart_in_child):
        obj._after_fork()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
