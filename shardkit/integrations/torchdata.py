"""torchdata's `StatefulDataLoader` around a `StreamingDataset`, with the saved state's workers checked on load.

A state saved with workers holds one state per worker, each counting that worker's own steps; one saved without
workers holds the position itself. torchdata takes either shape into a loader of any `num_workers` and fails at
the next iteration on its own keys (an `AssertionError` about `_num_yielded`, or a `KeyError`). This loader
refuses another number of workers in `load_state_dict`, saying which to use.
"""

from __future__ import annotations

from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader as TorchdataStatefulDataLoader


def saved_workers(state: dict[str, Any]) -> int | None:
    """The `num_workers` of the StatefulDataLoader that saved `state` (None: an empty or unknown state)."""
    if "_snapshot" in state:  # torchdata's multiprocessing iterator
        return int(state["_snapshot"]["_main_snapshot"]["_num_workers"])
    if "_num_yielded" in state:  # its single-process iterator
        return 0
    return None


class StatefulDataLoader(TorchdataStatefulDataLoader):
    """torchdata's `StatefulDataLoader` (same arguments) whose `load_state_dict` refuses a state saved with
    another `num_workers`.

    Raises:
        ValueError: from `load_state_dict`, naming the `num_workers` the state resumes with.
    """

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = saved_workers(state_dict)
        if saved is not None and saved != self.num_workers:
            raise ValueError(f"cannot resume: the loader state was saved by a StatefulDataLoader with "
                             f"num_workers={saved}, this one has num_workers={self.num_workers}: a worker's state "
                             f"counts that worker's steps only; resume it with num_workers={saved} "
                             "(docs/INTEGRATIONS.md)")
        super().load_state_dict(state_dict)
