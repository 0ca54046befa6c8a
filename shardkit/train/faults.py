"""Fault injection for the resumption tests: kill this process at a chosen point, first attempt only;
or make a chosen step's gradients overflow.

`SHARDKIT_FAULT_INJECT="WHERE:STEP[:RANK],..."` makes the rank (every rank when RANK is left out)
SIGKILL itself at `WHERE` = "step" (before optimizer step STEP runs) or "save" (after the checkpoint
of step STEP is written but before it is marked complete). It acts only on a job's first attempt
(`TORCHELASTIC_RESTART_COUNT` unset or 0), so that `torchrun --max-restarts` recovers. SIGKILL gives
the process no chance to clean up, like an out-of-memory kill or a lost node.

`WHERE` = "overflow" (under `--precision fp16`) scales the loss of optimizer step STEP far beyond what
fp16 holds, so that the rank's gradients overflow in its backward pass as a real overflow would. It acts
on every attempt: a resumed run meets the same batch again.
"""

from __future__ import annotations

import logging
import os
import signal

logger = logging.getLogger(__name__)

ENV_NAME = "SHARDKIT_FAULT_INJECT"
# The scale an injected overflow multiplies the loss by ("overflow:STEP"): any fp16 gradient overflows
# (2**64 times the scale is far above fp16's 65504), while the fp32 loss stays finite.
FORCED_OVERFLOW_FACTOR = 2.0 ** 64
WHERE = ("step", "save", "overflow")


def parse_faults(spec: str) -> list[tuple[str, int, int | None]]:
    """`"step:6:1,save:8"` -> [("step", 6, 1), ("save", 8, None)]."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        parts = item.split(":")
        if len(parts) not in (2, 3) or parts[0] not in WHERE:
            raise ValueError(f"{ENV_NAME}: expected WHERE:STEP[:RANK] with WHERE in {WHERE}, got {item!r}")
        faults.append((parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else None))
    return faults


def requested(where: str, step: int, rank: int) -> bool:
    """Whether the environment asks for a fault at `where` of `step` on `rank`."""
    return any(fault_where == where and fault_step == step and fault_rank in (None, rank)
               for fault_where, fault_step, fault_rank in parse_faults(os.environ.get(ENV_NAME, "")))


def inject_now(where: str, step: int, rank: int) -> None:
    """SIGKILL this process if the environment asks for a fault here (no-op otherwise)."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return
    if requested(where, step, rank):
        logger.warning("fault injection: rank %d kills itself at %s %d", rank, where, step)
        os.kill(os.getpid(), signal.SIGKILL)


def overflow_now(step: int, rank: int) -> bool:
    """Whether optimizer step `step` of `rank` must overflow (every attempt; see the module's docstring)."""
    if requested("overflow", step, rank):
        logger.warning("fault injection: rank %d overflows its gradients at step %d", rank, step)
        return True
    return False
