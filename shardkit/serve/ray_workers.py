"""Service workers as Ray actors (`shardkit serve DATA --ray ADDRESS --workers N`): Ray places them on its
cluster's nodes and restarts one that dies (on another node when its node is gone); a restarted worker registers
again with the dispatcher, and the consumers whose streams broke resume on any live worker from their own states.
"""

from __future__ import annotations

import threading
from typing import Any

from shardkit.serve.data import DataSpec


class RayWorker:
    """One worker: a `WorkerServer` on its node's address, with its heartbeats to the dispatcher."""

    def __init__(self, spec_json: str, dispatcher: str, token: str | None, host: str | None):
        import ray

        from shardkit.serve.dispatcher import run_heartbeats
        from shardkit.serve.worker import WorkerServer

        host = host or ray.util.get_node_ip_address()
        self.server = WorkerServer(DataSpec.from_json(spec_json), location=f"grpc://{host}:0", token=token)
        self.location = f"grpc://{host}:{self.server.port}"
        self.stop = threading.Event()
        threading.Thread(target=run_heartbeats, daemon=True, name="heartbeats",
                         kwargs=dict(server=self.server, dispatcher=dispatcher, advertised=self.location,
                                     token=token, stop=self.stop)).start()

    def where(self) -> dict[str, Any]:
        import os

        return {"location": self.location, "pid": os.getpid()}


def start_ray_workers(spec: DataSpec, *, address: str, count: int, dispatcher: str, token: str | None,
                      host: str | None = None) -> list[Any]:
    """`count` worker actors on the Ray cluster at `address` (connecting to it when this process is not yet),
    spread over its nodes, restarted by Ray without limit. Returns their handles (keep them: an actor whose
    handles are all dropped ends)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
    actor = ray.remote(num_cpus=1, max_restarts=-1, scheduling_strategy="SPREAD")(RayWorker)
    workers = [actor.remote(spec.to_json(), dispatcher, token, host) for _ in range(count)]
    ray.get([worker.where.remote() for worker in workers])
    return workers
