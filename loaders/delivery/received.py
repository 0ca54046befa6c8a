"""A loader's state counts the batches the training step received, whatever the framework fetched ahead.

Two frameworks account for read-ahead in opposite ways:

- Lightning's fit loop (`_PrefetchDataFetcher`) reads one batch ahead of the training step when the loader has no
  length (raw text; built data with token-budget batches) and asks the loader for its state at a checkpoint with
  that batch still in its hands. A state counting every batch handed out resumes one batch late: the batch held
  back is never trained, and nothing says so.
- torchdata.nodes' prefetchers take the state right after each `next()` and, on restore, skip the items they
  yielded since: there the state must count every batch handed out, or torchdata delivers one twice.

So the loader counts every batch it hands out (right for torchdata, a plain loop, accelerate and the transformers
Trainer), and when a fetcher that holds batches back iterates it (found among the callers when the iteration
starts: `frameworks.holding_fetcher`), it also notes its position before each batch; its state is then the one
before the first of its batches the fetcher still holds (`HeldBatches.position`). A state asked while such a
fetcher holds batches of an iteration that was not followed is refused (`frameworks.refuse_untracked_fetcher`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any


def _leaves(item: Any, depth: int = 3) -> Iterator[Any]:
    """`item` and what it nests in tuples, lists and dict values (a combined loader's `(batch, index, loader)`)."""
    yield item
    if depth and isinstance(item, (tuple, list)):
        for part in item:
            yield from _leaves(part, depth - 1)
    elif depth and isinstance(item, dict):
        for part in item.values():
            yield from _leaves(part, depth - 1)


class HeldBatches:
    """Follows one iteration of a loader under a fetcher that holds batches back (`fetcher.batches`, a list).

    Args:
        fetcher: the framework's fetcher (Lightning's `_PrefetchDataFetcher`).
        position: the loader's local state now (`Feed.local_state_dict`).
        ahead: the most batches the fetcher reads ahead (`prefetch_batches`).
    """

    def __init__(self, fetcher: Any, position: Callable[[], dict[str, Any]], *, ahead: int):
        self.fetcher, self._position = fetcher, position
        # (batch, the position before it) of the last batches handed out: the batches themselves (not their ids)
        # so that the identity test below never matches a freed batch's recycled id. One more than the fetcher
        # can hold, to tell "the oldest noted is held" from "an older one is held too".
        self._handed: deque[tuple[Any, dict[str, Any]]] = deque(maxlen=max(1, ahead) + 1)

    def follow(self, batches: Iterator[Any]) -> Iterator[Any]:
        """`batches`, noting the position before each."""
        try:
            before = self._position()
            for batch in batches:
                self._handed.append((batch, before))
                yield batch
                before = self._position()
        finally:
            self._handed.clear()
            close = getattr(batches, "close", None)
            if close is not None:
                close()

    def position(self) -> dict[str, Any] | None:
        """The local state before the first batch the fetcher still holds (None: it holds none of ours).

        Raises:
            ValueError: the fetcher holds more batches than were noted (its read-ahead grew after the start).
        """
        held = {id(leaf) for item in list(getattr(self.fetcher, "batches", ()) or ()) for leaf in _leaves(item)}
        for index, (batch, before) in enumerate(self._handed):
            if id(batch) in held:
                if index == 0 and len(self._handed) == self._handed.maxlen:
                    raise ValueError("cannot take the loader state: the framework's fetcher holds more batches "
                                     f"than the {self._handed.maxlen - 1} it said it reads ahead, so the batches "
                                     "the training step received are unknown")
                return before
        return None
