"""Whether a dataset has been iterated in DataLoader worker processes, seen from the process that made it.

With `DataLoader(dataset, num_workers=N)` each worker iterates its own copy of the dataset; the training process's
copy never moves, so its `state_dict()` would say that nothing was read, and a resume would train the epoch again.
The workers raise a flag in memory shared with that process (inherited by fork, passed to spawned and forkserver
workers when the dataset is sent to them), and `state_dict()` there refuses.
"""

from __future__ import annotations

import multiprocessing.context
import multiprocessing.sharedctypes
from typing import Any

from torch.utils.data import get_worker_info


class WorkerIterations:
    """A flag the dataset's copies in DataLoader workers raise when they start iterating."""

    def __init__(self) -> None:
        self._flag: Any = multiprocessing.sharedctypes.RawValue("b", 0)

    def __getstate__(self) -> dict:
        # Shared memory travels only to a worker being started; any other pickle (a copy for another purpose)
        # gets no flag, so it never refuses.
        spawning = multiprocessing.context.get_spawning_popen() is not None
        return {"_flag": self._flag if spawning else None}

    def note_iteration(self) -> None:
        """Called when an iteration starts: raises the flag inside a DataLoader worker."""
        if self._flag is not None and get_worker_info() is not None:
            self._flag.value = 1

    def check_state_here(self) -> None:
        """Refuse a state taken in the training process of a dataset that workers iterate.

        Raises:
            ValueError: naming the loaders that save the workers' positions.
        """
        if self._flag is not None and self._flag.value and get_worker_info() is None:
            raise ValueError("StreamingDataset.state_dict() in the training process, but DataLoader workers "
                             "iterate their own copies of the dataset: this copy never moved, and its state would "
                             "resume the epoch from its start. Save the state of a StreamingDataLoader (or of "
                             "torchdata's StatefulDataLoader, which gathers its workers' states), or use num_workers=0 "
                             "(docs/INTEGRATIONS.md)")
