"""What this process may use and what it is: the cores its affinity allows, and whether it is a DataLoader
worker (asked without importing torch: a process that has not loaded torch is no worker, and must not pay
torch's import, seconds, for the answer)."""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["available_cores", "loader_worker_info"]


def available_cores() -> int:
    """Cores this process may run on (affinity-aware), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS / Windows
        return max(1, os.cpu_count() or 1)


def loader_worker_info() -> Any | None:
    """torch's `get_worker_info()` in a DataLoader worker (its id and `num_workers`), else None."""
    data = sys.modules.get("torch.utils.data")  # a worker has it loaded already
    return data.get_worker_info() if data is not None else None
