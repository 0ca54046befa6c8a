"""The processes below a process, from /proc (Linux), and signalling a whole tree: for tests that kill a
launcher with its workers or dump the stacks of a stuck process and its children."""

from __future__ import annotations

import os
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every descendant of `pid`, each after its parent (from the parent pid of every /proc entry, so
    processes in sessions of their own, such as torchrun's workers, are found too)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def signal_all(pids: list[int], sig: int) -> None:
    """Send `sig` to each of `pids`; one that has exited already is skipped."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
