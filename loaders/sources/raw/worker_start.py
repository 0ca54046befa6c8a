"""`WorkerStart`: where persistent DataLoader workers begin their next iteration of raw text.

A raw-text iteration never ends on its own: the training loop stops it, and the next one continues where the loader
stands (consumed positions, the lanes' cursors), while the workers have read ahead of it. Persistent workers keep
their copy of the source across iterations and start each new iteration from what that copy holds, which the
loader cannot change once they run; so the loader writes where the next iteration starts into shared memory before
it resumes them, and each worker reads it as it begins (`RawTextSource.batches`). A few integers per lane, no pickle.
"""

from __future__ import annotations

import multiprocessing.context
import multiprocessing.sharedctypes
from dataclasses import replace
from typing import Any

import numpy as np

from .corpus import CURSOR_FIELDS, cursor_rows
from .iteration import RawIteration

_HEADER = 3  # written (0: never), start, cursor rows
_ROW = 1 + CURSOR_FIELDS  # lane, *cursor


class WorkerStart:
    """The start of the next iteration, shared with the DataLoader workers that the source is sent to.

    Args:
        num_lanes: the source's lanes (at most one cursor row each).
    """

    def __init__(self, num_lanes: int):
        self._values: Any = multiprocessing.sharedctypes.RawArray("q", _HEADER + num_lanes * _ROW)
        self.num_lanes = num_lanes

    def __getstate__(self) -> dict:
        # Shared memory travels only to a worker being started; any other copy reads no start (as WorkerIterations).
        spawning = multiprocessing.context.get_spawning_popen() is not None
        return {"_values": self._values if spawning else None, "num_lanes": self.num_lanes}

    def write(self, iteration: RawIteration) -> None:
        """Where the next iteration starts: its consumed positions and its lanes' cursors."""
        values = np.frombuffer(self._values, dtype=np.int64)
        rows = np.array(cursor_rows(iteration.cursors), dtype=np.int64).reshape(-1, _ROW)
        values[1], values[2] = iteration.start, len(rows)
        values[_HEADER:_HEADER + rows.size] = rows.reshape(-1)
        values[0] = 1

    def read(self, iteration: RawIteration) -> RawIteration:
        """`iteration` (what the worker's copy began with) starting where the loader last wrote; unchanged when it
        never wrote or this copy has no shared memory."""
        if self._values is None:
            return iteration
        values = np.frombuffer(self._values, dtype=np.int64)
        if not values[0]:
            return iteration
        rows = values[_HEADER:_HEADER + int(values[2]) * _ROW].reshape(-1, _ROW)
        cursors = {int(row[0]): tuple(int(v) for v in row[1:]) for row in rows}
        return replace(iteration, start=int(values[1]), cursors=cursors)
