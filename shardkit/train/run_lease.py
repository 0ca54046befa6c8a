"""One job per run directory: a lease that the newest job takes, so that two jobs formed from one rendezvous
(a split brain) cannot both write the same checkpoints.

torchrun's agents drop a node whose keep-alive is older than `keep_alive_interval` x `keep_alive_max_attempt`.
Set that window shorter than a loaded host's worst heartbeat delay and a returning node may declare the running
one dead and form a second job beside it, with the same run directory: both then save, resume and prune the
same checkpoints (docs/GOODPUT.md). The guard: rank 0 of every job takes the lease (`job-lease.json` in the run
directory) as it starts, before it reads a checkpoint; at each sync point, before any checkpoint is written or
pruned, it checks that the lease is still its own. A job that finds it taken stops with an error that names the
other job, and its agent's next rendezvous round joins the two again. A job that died leaves the lease behind
and the next one takes it at once: a restart never waits for a lease to expire.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardkit.storage import write_file_atomic

LEASE_NAME = "job-lease.json"


@dataclass(frozen=True, kw_only=True)
class RunLease:
    """The lease this job took on its run directory.

    Attributes:
        path: the lease file.
        holder: what the file says of this job (a unique id, host, pid, world size, torchrun's restart count).
    """

    path: Path
    holder: dict[str, Any]

    @classmethod
    def take(cls, run_dir: Path) -> RunLease:
        """Take the lease on `run_dir` (rank 0, as the job starts), from whichever job held it."""
        holder = {"id": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(), "taken": time.time(),
                  "world_size": int(os.environ.get("WORLD_SIZE", "1")),
                  "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}
        path = run_dir / LEASE_NAME
        write_file_atomic(str(path), json.dumps(holder, indent=1).encode())
        return cls(path=path, holder=holder)

    def taken_by(self) -> dict[str, Any] | None:
        """The holder of a newer job that took the lease since, or None while it is this job's (a file that is
        gone or unreadable counts as this job's: only a newer job's lease stops it)."""
        try:
            current = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(current, dict) or current.get("id") == self.holder["id"]:
            return None
        return current

    def lost_message(self, other: dict[str, Any]) -> str:
        """One line for a job whose lease another job took."""
        return (f"another job took over run directory {self.path.parent} (rank 0 on {other.get('host')}, pid "
                f"{other.get('pid')}, world size {other.get('world_size')}): two jobs formed from one rendezvous "
                "(a split brain), so this one stops before it writes a checkpoint; its agent's next rendezvous "
                "round joins them again. If it recurs, raise torchrun's keep-alive window (--rdzv-conf "
                "keep_alive_interval=...,keep_alive_max_attempt=...) above the hosts' worst heartbeat delay")
