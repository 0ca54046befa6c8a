"""The batches a loader hands to the training loop and the time it waited for them, published as metrics in
groups (`shardkit_loader_batches_total`, `shardkit_loader_wait_seconds_total`): `counted_batches`, the hand-out
loop of every loader."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from shardkit import metrics

from .waiting import WaitNotice

_PUBLISH_BATCHES = 64  # batch metrics are published every this many batches, or every second, or at the end
_PUBLISH_SECONDS = 1.0


class BatchCounts:
    """Batches handed out and the time waited for them, counted locally and published in groups
    (`shardkit_loader_batches_total` and `_wait_seconds_total` lag by at most 64 batches or a second)."""

    def __init__(self) -> None:
        self.batches, self.waited, self.published = 0, 0.0, time.perf_counter()

    def add(self, waited: float, now: float) -> None:
        self.batches += 1
        self.waited += waited
        if self.batches >= _PUBLISH_BATCHES or now - self.published >= _PUBLISH_SECONDS:
            self.publish(now)

    def publish(self, now: float) -> None:
        if self.batches:
            metrics.loader_batches(self.batches, self.waited)
        self.batches, self.waited, self.published = 0, 0.0, now


def counted_batches(source: Iterable[dict[str, Any]], prepare: Callable[[dict[str, Any]], dict[str, Any]], *,
                    pin: bool, waiting_for: str) -> Iterator[dict[str, Any]]:
    """The batches `prepare` makes of `source`'s arrays (tensors, pinned when `pin`), counted in the metrics.
    `prepare` runs before its batch is handed out: a position it advances includes that batch, as a state saved
    after receiving it must. A first batch that takes long is announced, saying it waits for `waiting_for`
    (`shardkit.loaders.delivery.waiting`)."""
    counts, asked = BatchCounts(), time.perf_counter()
    notice = WaitNotice(waiting_for)
    try:
        for arrays in source:
            batch = prepare(arrays)
            if pin:
                batch = {k: v.pin_memory() for k, v in batch.items()}
            notice.done()
            now = time.perf_counter()
            counts.add(now - asked, now)
            yield batch
            asked = time.perf_counter()
    finally:
        notice.done()
        counts.publish(time.perf_counter())
