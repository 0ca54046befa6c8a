"""Objects that start over in a process forked from this one.

A DataLoader forks its workers whatever the parent's other threads are doing at that instant. Two things
the child inherits are then broken: a lock another thread held (nothing in the child will release it), and
a thread pool (its threads do not exist in the child, but the pool counts them as idle, so work submitted
there never runs). Either hangs the worker for good. An object owning such state registers here, and in
every child forked afterwards its `_after_fork()` runs right after the fork, while the child has one thread,
to make that state again (what unpickling in a spawned worker does).
"""

from __future__ import annotations

import os
import weakref

_restart_in_child: weakref.WeakSet = weakref.WeakSet()


def restart_after_fork(obj) -> None:
    """Call `obj._after_fork()` in each child forked from this process from now on (while `obj` lives)."""
    _restart_in_child.add(obj)


def _after_fork_in_child() -> None:
    for obj in list(_restart_in_child):
        obj._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
