"""`python -m shardkit.train.elastic [torchrun options] -m shardkit.train [options]`: torchrun for elastic jobs.

It is torchrun (`torch.distributed.run`), with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 set for its agent unless
the environment already sets it: since torch 2.4 the c10d rendezvous shares its store with the workers, and
a node that leaves then never rejoins (docs/PARALLELISM.md, "Elastic training"). With this launcher on every
node the variable cannot be forgotten; the trainer warns on rank 0 when it was (`warn_if_nodes_cannot_rejoin`).

With SHARDKIT_WARM_START=1 it also starts the node's warm-start server (`shardkit.train.warm`) as the agent
starts, so that it imports torch while the agent waits for its rendezvous: even the node's first workers (a
node that returns after a loss) are forked warm. Under plain torchrun the first worker starts the server.
"""

from __future__ import annotations

import os
import sys

from shardkit.train import warm
from shardkit.train.parallel.runtime import REJOIN_VARIABLE


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault(REJOIN_VARIABLE, "1")  # read by the agent's rendezvous handler, after this point
    if warm.requested():
        try:
            warm.idle_timeout()  # a bad value stops the launch here, in the user's terminal
        except ValueError as err:
            sys.exit(f"error: {err}")
        warm.start_server(warm.socket_path(os.getpid()), os.getpid())  # this process is the agent
    from torch.distributed.run import main as torchrun

    torchrun(argv)


if __name__ == "__main__":
    main()
