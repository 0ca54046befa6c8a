"""`ServiceFeed`: the loader's side of a served source. The consumer's own state is the truth.

Each batch arrives with the loader state after it (the global state of built data; raw text's rank state, whose
lane cursors `state_dict()` merges over the ranks as the raw-text feed does). The feed keeps the state of the
last batch it handed to the training loop; when a stream breaks (a worker killed, hung past the deadline, gone)
it asks the dispatcher for another worker and resumes from that state: the order is a pure function of the data,
seed, step and topology, so nothing is lost, nothing is read twice, and the order is the in-process one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from shardkit import metrics

from ...delivery.batch_counts import counted_batches
from ...delivery.tensors import batch_to_tensors
from ...source import Feed
from ...state.loader_state import LoaderState
from ..raw.feed import gathered_state
from .client import BatchStream, StreamBroken
from .wire import StreamRequest

logger = logging.getLogger(__name__)

RETRY_SECONDS = 0.2  # between streams that broke without a batch (a restarted worker takes seconds to join)
_STATE_KEY = "__service_state__"


class ServiceFeed(Feed):
    """The loader's side of a `ServiceSource`, `batch_size` samples per rank per step."""

    def __init__(self, source: Any, loader: Any, batch_size: int | None):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if loader.num_workers:
            raise ValueError("num_workers must be 0 with service=: the service's workers do the reading")
        self.source = source
        self.samples_per_rank = batch_size
        self._state: dict[str, Any] | None = None  # the loader state after the last batch handed out
        self._allow_mixture_change = False
        self.reassignments = 0

    def _request(self, state: dict[str, Any] | None, *, part: int = 0, parts: int = 1) -> StreamRequest:
        topology = self.source.topology()
        return StreamRequest(rank=topology.rank, world_size=topology.world_size, local_rank=topology.local_rank,
                             local_world_size=topology.local_world_size, batch_size=self.samples_per_rank,
                             identity=self.source.identity(), state=state,
                             allow_mixture_change=self._allow_mixture_change, part=part, parts=parts)

    def _ask_worker(self, action: str, state: dict[str, Any] | None) -> dict[str, Any]:
        (_, location), = self.source.client.route([])
        return self.source.client.worker_action(action, location, self._request(state))

    @property
    def epoch(self) -> int:
        return 0 if self._state is None or self.source.endless else LoaderState.from_dict(self._state).epoch

    def length(self) -> int:
        if self.source.endless:
            raise TypeError("a raw-text StreamingDataLoader has no length: its lanes go on epoch after epoch (stop "
                            "after a number of steps)")
        answer = self._ask_worker("length", self._state)
        if "error" in answer:
            raise TypeError(answer["error"])
        return int(answer["length"])

    def batches(self, loader: Any) -> Iterator[dict[str, torch.Tensor]]:
        def prepare(arrays: dict[str, Any]) -> dict[str, torch.Tensor]:
            self._state = arrays.pop(_STATE_KEY)
            return batch_to_tensors(arrays)

        return counted_batches(self._received(), prepare, pin=loader.pin_batches and torch.cuda.is_available(),
                               waiting_for=f"the data service at {self.source.client.url}")

    def _received(self) -> Iterator[dict[str, Any]]:
        """The numpy batches of one iteration, each with its state, across as many streams as it takes: one
        worker's whole batches, or, where the source's steps are read in parts and several workers are live, one
        part of every step from each of them (`parts`)."""
        source = self.source
        exclude: list[str] = []
        failing_since: float | None = None  # the first of the streams that broke in a row without a batch
        while True:
            routes = source.client.route(exclude, workers=source.parts if source.assembly else 1)
            streams: list[BatchStream] = []
            try:
                for part, (worker, location) in enumerate(routes):
                    request = self._request(self._state, part=part, parts=len(routes))
                    streams.append(source.client.open_stream(worker, location, request, prefetch=source.prefetch))
                for arrays in self._whole(streams[0]) if len(streams) == 1 else self._assembled(streams):
                    failing_since = None
                    yield arrays
                return
            except StreamBroken as err:
                exclude, failing_since = self._broken(err.worker, exclude, failing_since, err)
            finally:
                for stream in streams:
                    stream.close()

    def _whole(self, stream: BatchStream) -> Iterator[dict[str, Any]]:
        """One worker's batches, each with the state after it, to the iteration's end."""
        for arrays, state, last in stream.messages(self.source.client.timeout):
            if arrays:
                arrays[_STATE_KEY] = state
                yield arrays
            else:
                self._state = state  # the end of an epoch: where the next iteration starts
            if last:
                return
        if self.source.endless:
            raise StreamBroken("the stream of endless data ended", worker=stream.worker)

    def _assembled(self, streams: list[BatchStream]) -> Iterator[dict[str, Any]]:
        """Each step assembled from one part per stream (in part order), with the state after it (endless)."""
        received = [stream.messages(self.source.client.timeout) for stream in streams]
        global_batch = self.samples_per_rank * self.source.topology().world_size
        state = self._state
        while True:
            parts = []
            for stream, messages in zip(streams, received):
                message = next(messages, None)
                if message is None:
                    raise StreamBroken("the stream of endless data ended", worker=stream.worker)
                parts.append(message[0])
                state = message[1] or state  # a stream's first message: the state where its iteration began
            arrays = self.source.assembly.batch(parts)
            arrays[_STATE_KEY] = state = self.source.assembly.state_after(state, parts, global_batch=global_batch)
            yield arrays

    def _broken(self, worker: str, exclude: list[str], failing_since: float | None,
                err: Exception) -> tuple[list[str], float]:
        """Note a broken stream; the consumer waits up to `service_timeout` for a worker that serves again.

        Raises:
            ConnectionError: no stream gave a batch for `service_timeout` seconds.
        """
        now = time.monotonic()
        failing_since = now if failing_since is None else failing_since
        if now - failing_since > self.source.client.timeout:
            raise ConnectionError(f"data service {self.source.client.url}: no worker served a batch for "
                                  f"{self.source.client.timeout:g} s ({str(err).splitlines()[0]}); the last state "
                                  "stays resumable") from None
        self.reassignments += 1
        metrics.inc("shardkit_service_reassignments_total")
        logger.warning("data service: worker %s stream broke (%s); resuming on another worker", worker,
                       str(err).splitlines()[0])
        time.sleep(RETRY_SECONDS)
        return [*exclude[-8:], worker], failing_since

    # -- state ---------------------------------------------------------------------------------
    def local_state_dict(self) -> dict[str, Any]:
        if self._state is None:
            self._state = self._ask_worker("state", None)["state"]
        return self._state

    def state_dict(self) -> dict[str, Any]:
        return self.global_state(self.local_state_dict())

    def global_state(self, local: dict[str, Any]) -> dict[str, Any]:
        if not self.source.endless:  # built data's state is global already
            return local
        return gathered_state(local, self.source.topology_group, what="a served raw-text loader")

    def load_state_dict(self, state: dict[str, Any], *, allow_mixture_change: bool = False) -> None:
        if not isinstance(state, dict):
            raise ValueError(f"cannot resume: a loader state is a dict, got {type(state).__name__}")
        self._allow_mixture_change = allow_mixture_change
        # A worker loads it into this rank's loader: a state of other data or settings is refused now, naming the
        # field, and the answer is this rank's state (a raw-text state's cursors as this rank keeps them).
        self._state = self._ask_worker("state", state)["state"]
        self._allow_mixture_change = False
