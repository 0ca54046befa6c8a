"""A service worker: a Flight server that streams the batches of any consumer rank from any loader state.

For a request (`StreamRequest`: rank, topology, batch size, state) the worker builds the loader that rank would
build in process (`DataSpec.loader`), loads the state and sends each batch as an Arrow record batch with the
loader state after it. It holds nothing a consumer needs afterwards: killing it loses no position.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pyarrow.flight as flight

from shardkit.loaders.sources.service.parts import served_parts
from shardkit.loaders.sources.service.wire import REFUSED, StreamRequest, batch_schema, decode_object, encode_batch
from shardkit.serve.data import DataSpec
from shardkit.serve.security import middleware

logger = logging.getLogger(__name__)


def refused(reason: str) -> flight.FlightServerError:
    """A refusal the consumer raises as it is (retrying elsewhere cannot cure it)."""
    return flight.FlightServerError(REFUSED + reason.splitlines()[0] if reason else REFUSED + "bad request")


def json_result(answer: dict[str, Any]) -> list[flight.Result]:
    return [flight.Result(json.dumps(answer).encode())]


class WorkerServer(flight.FlightServerBase):
    """Serves `spec` at `location` (grpc://HOST:PORT; port 0: any free port).

    Attributes:
        description: what consumers are told of the data (`DataSpec.describe`), with `data`: the spec's source.
    """

    def __init__(self, spec: DataSpec, *, location: str, token: str | None):
        super().__init__(location, middleware=middleware(token))
        self.spec = spec
        self.description = {**spec.describe(), "data": spec.source if isinstance(spec.source, str) else None}
        self._lock = threading.Lock()
        self.closing = threading.Event()  # set by `stop_server`: streams end at their next message
        self.active_streams = 0
        self.batches_sent = 0
        self.rows_sent = 0

    # -- requests ------------------------------------------------------------------------------
    def _loader(self, body: bytes) -> tuple[StreamRequest, Any]:
        """The request and its rank's loader at the request's state; a bad request is refused (one line)."""
        try:
            request = StreamRequest.from_bytes(body)
        except ValueError as err:
            raise refused(str(err)) from None
        if request.identity != self.description["identity"]:
            raise refused(f"this service serves {self.description['describe']} (identity "
                          f"{self.description['identity']}), the consumer reads {request.identity}: point it at "
                          "the service of its data")
        try:
            loader = self.spec.loader(rank=request.rank, world_size=request.world_size, local_rank=request.local_rank,
                                      local_world_size=request.local_world_size, batch_size=request.batch_size)
            if request.state is not None:
                loader.load_state_dict(request.state, allow_mixture_change=request.allow_mixture_change)
        except (ValueError, TypeError, KeyError) as err:
            raise refused(f"{type(err).__name__}: {err}") from None
        return request, loader

    def do_get(self, context: Any, ticket: flight.Ticket) -> flight.FlightDataStream:
        request, loader = self._loader(ticket.ticket)
        messages = self._whole_batches(loader) if request.parts == 1 else self._step_parts(loader, request)
        try:
            first = next(messages)
        except (ValueError, OSError) as err:
            raise refused(f"{type(err).__name__}: {err}") from None
        schema = batch_schema(first[0] or {})
        with self._lock:
            self.active_streams += 1
        return flight.GeneratorStream(schema, self._sent(first, messages, schema))

    def _sent(self, first: tuple[Any, dict[str, Any], bool], messages: Iterator[tuple[Any, dict[str, Any], bool]],
              schema: Any) -> Iterator[tuple[Any, bytes]]:
        """The stream's Arrow messages, counted; bad data met on the way is a refusal, the same on every worker."""
        try:
            message: tuple[Any, dict[str, Any], bool] | None = first
            while message is not None:
                if self.closing.is_set():  # an error, not an end: the consumer continues on another worker
                    raise flight.FlightUnavailableError("the worker is shutting down")
                arrays, state, last = message
                yield encode_batch(arrays or {}, schema, state=state, last=last)
                if arrays is None:  # only a state: the iteration was empty
                    return
                with self._lock:
                    self.batches_sent += 1
                    self.rows_sent += len(arrays["rows"] if "rows" in arrays else next(iter(arrays.values())))
                message = next(messages, None)
        except (ValueError, OSError) as err:
            raise refused(f"{type(err).__name__}: {err}") from None
        finally:
            messages.close()
            with self._lock:
                self.active_streams -= 1

    def _whole_batches(self, loader: Any) -> Iterator[tuple[dict[str, Any], dict[str, Any], bool]]:
        """(arrays, the loader state after them, last) per batch; of an epoch's last batch (found by reading one
        ahead), the state after the epoch, so that a consumer holding it starts the next epoch in its next
        iteration. An empty iteration (a state at an epoch's end) is one message of its state only (arrays None)."""
        endless = self.description["endless"]
        batches = iter(loader)
        try:
            arrays = _numpy(next(batches, None))
            if arrays is None:
                yield None, loader.local_state_dict(), True
                return
            while arrays is not None:
                state = loader.local_state_dict()
                following = None if endless else next(batches, None)
                last = not endless and following is None
                if last:
                    state = loader.local_state_dict()  # the epoch ended: the state of the next one
                yield arrays, state, last
                if endless:
                    following = next(batches, None)
                arrays = _numpy(following)
        finally:
            batches.close() if hasattr(batches, "close") else None

    def _step_parts(self, loader: Any, request: StreamRequest) -> Iterator[tuple[dict[str, Any], dict[str, Any], bool]]:
        """(arrays, state, False) per step: part `request.part` of each. The consumer keeps the state: the first
        message carries the loader's state where the iteration began (a mixture's order pinned to the global batch
        then), the others none."""
        if self.description["assembly"] is None:
            raise refused(f"{self.description['describe']} is not read in parts: ask for whole batches (parts=1)")
        parts = served_parts(loader, part=request.part, parts=request.parts)
        try:
            yield next(parts), loader.local_state_dict(), False
            for arrays in parts:
                yield arrays, {}, False
        finally:
            parts.close()

    def do_action(self, context: Any, action: flight.Action) -> list[flight.Result]:
        kind = action.type
        if kind == "describe":
            return json_result(self.description)
        if kind not in ("state", "length"):
            raise refused(f"unknown action {kind!r} (a worker answers describe, state and length)")
        try:
            body = json.dumps(decode_object(action.body.to_pybytes(), what=kind)).encode()
        except ValueError as err:
            raise refused(str(err)) from None
        _, loader = self._loader(body)
        if kind == "state":
            return json_result({"state": loader.local_state_dict()})
        try:
            return json_result({"length": len(loader)})
        except TypeError as err:
            return json_result({"error": str(err)})

    def list_actions(self, context: Any) -> list[tuple[str, str]]:
        return [("describe", "the data served"), ("state", "a rank's loader state, loaded from a request's state"),
                ("length", "batches per epoch for a request's rank")]

    def load(self) -> dict[str, int]:
        with self._lock:
            return {"streams": self.active_streams, "batches": self.batches_sent, "rows": self.rows_sent}


def _numpy(batch: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if batch is None else {name: tensor.numpy() for name, tensor in batch.items()}
