"""`python -m shardkit.train.elastic [torchrun options] -m shardkit.train [options]`: torchrun for elastic jobs.

It is torchrun (`torch.distributed.run`), with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 set for its agent unless
the environment already sets it: since torch 2.4 the c10d rendezvous shares its store with the workers, and
a node that leaves then never rejoins (docs/PARALLELISM.md, "Elastic training"). With this launcher on every
node the variable cannot be forgotten; the trainer warns on rank 0 when it was (`warn_if_nodes_cannot_rejoin`).
"""

from __future__ import annotations

import os

from shardkit.train.parallel.runtime import REJOIN_VARIABLE


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault(REJOIN_VARIABLE, "1")  # read by the agent's rendezvous handler, after this point
    from torch.distributed.run import main as torchrun

    torchrun(argv)


if __name__ == "__main__":
    main()
