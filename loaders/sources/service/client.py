"""The consumer's calls to a service: the dispatcher (describe the data, route to a worker) and a worker's stream,
read ahead by a thread into a bounded queue.

Errors fall in two kinds. A refusal (`wire.REFUSED`: a malformed request, a state of other data, a missing token)
cannot be cured by asking elsewhere: it is raised as `ValueError` / `PermissionError` with the server's one-line
reason. Anything else (a worker gone, a broken connection, no batch before the deadline) is `StreamBroken`: the
feed asks the dispatcher for another worker and resumes from its last state.
"""

from __future__ import annotations

import json
import os
import queue
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

from shardkit import metrics

from .wire import REFUSED, StreamRequest, decode_batch, decode_object

TOKEN_ENV = "SHARDKIT_SERVICE_TOKEN"
_END = object()
_RETRY_SECONDS = 0.2


class StreamBroken(ConnectionError):
    """A worker's stream ended before its iteration did (the feed resumes it elsewhere).

    Attributes:
        worker: the id of the worker whose stream broke.
    """

    def __init__(self, message: str, *, worker: str):
        super().__init__(message)
        self.worker = worker


def call_options(token: str | None, timeout: float | None = None) -> Any:
    """Flight call options carrying the shared token (`authorization: Bearer TOKEN`)."""
    import pyarrow.flight as flight

    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    return flight.FlightCallOptions(headers=headers, timeout=timeout)


def refusal(err: BaseException) -> Exception | None:
    """The `ValueError` / `PermissionError` a server's refusal means, or None for a failure worth a retry."""
    import pyarrow.flight as flight

    text = str(err)
    if REFUSED not in text:
        return None
    reason = text[text.index(REFUSED) + len(REFUSED):]
    reason = re.split(r"\. Detail:|\. gRPC client debug context|\n", reason)[0].strip()
    kind = PermissionError if isinstance(err, flight.FlightUnauthenticatedError) else ValueError
    return kind(f"data service: {reason}")


class ServiceClient:
    """Calls to the dispatcher at `url` (grpc://host:port) with the shared `token`."""

    def __init__(self, url: str, *, token: str | None, timeout: float):
        if not isinstance(url, str) or not re.match(r"^grpc(\+tcp|\+tls)?://[^/]+:\d+/?$", url):
            raise ValueError(f"service={url!r}: give the dispatcher's address as grpc://HOST:PORT")
        self.url, self.timeout = url, timeout
        self._token = token or os.environ.get(TOKEN_ENV) or None
        self._dispatcher: Any = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_dispatcher": None}  # a Flight client does not cross processes

    def _client(self) -> Any:
        import pyarrow.flight as flight

        if self._dispatcher is None:
            self._dispatcher = flight.FlightClient(self.url)
        return self._dispatcher

    def _retrying(self, what: str, call: Any) -> Any:
        """`call()` until it answers or `timeout` passes (a service starting, a dispatcher restarting)."""
        import pyarrow as pa

        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return call()
            except (pa.ArrowException, OSError) as err:
                refused = refusal(err)
                if refused is not None:
                    raise refused from None
                if time.monotonic() >= deadline:
                    raise ConnectionError(f"data service {self.url}: {what} failed for {self.timeout:g} s "
                                          f"({str(err).splitlines()[0]})") from None
                self._dispatcher = None
                time.sleep(_RETRY_SECONDS)

    def action(self, name: str, body: dict[str, Any], *, client: Any = None) -> dict[str, Any]:
        """One action's JSON answer (on the dispatcher, or on `client`: a worker)."""
        import pyarrow.flight as flight

        def call() -> dict[str, Any]:
            target = client or self._client()
            results = list(target.do_action(flight.Action(name, json.dumps(body).encode()),
                                            call_options(self._token, self.timeout)))
            return decode_object(results[0].body.to_pybytes(), what=f"answer to {name}")

        return self._retrying(name, call)

    def route(self, exclude: list[str], *, workers: int = 1) -> list[tuple[str, str]]:
        """(worker id, location) of up to `workers` distinct live workers (at least one), none of `exclude` where
        others are live."""
        import pyarrow.flight as flight

        descriptor = flight.FlightDescriptor.for_command(json.dumps({"exclude": exclude, "workers": workers}).encode())

        def call() -> list[tuple[str, str]]:
            info = self._client().get_flight_info(descriptor, call_options(self._token, self.timeout))
            return [(e.ticket.ticket.decode(), e.locations[0].uri.decode()) for e in info.endpoints]

        return self._retrying("finding a worker", call)

    def worker_action(self, name: str, location: str, request: StreamRequest) -> dict[str, Any]:
        import pyarrow.flight as flight

        client = flight.FlightClient(location)
        try:
            return self.action(name, json.loads(request.to_bytes()), client=client)
        finally:
            client.close()

    def open_stream(self, worker: str, location: str, request: StreamRequest, *, prefetch: int) -> BatchStream:
        """Worker `worker`'s stream of `request`.

        Raises:
            StreamBroken: the worker cannot be reached (gone since the dispatcher last heard of it).
            ValueError, PermissionError: the worker refused the request.
        """
        import pyarrow as pa
        import pyarrow.flight as flight

        client = flight.FlightClient(location)
        try:
            reader = client.do_get(flight.Ticket(request.to_bytes()), call_options(self._token))
        except (OSError, pa.ArrowException) as err:
            client.close()
            refused = refusal(err)
            if refused is not None:
                raise refused from None
            raise StreamBroken(str(err).splitlines()[0] if str(err) else type(err).__name__, worker=worker) from None
        return BatchStream(client, reader, prefetch=prefetch, worker=worker)


class BatchStream:
    """One worker's stream, read ahead by a thread into a queue of at most `prefetch` decoded batches (with
    gRPC's flow control behind it, the worker runs at most that far ahead of the training loop)."""

    def __init__(self, client: Any, reader: Any, *, prefetch: int, worker: str):
        self._client, self._reader, self.worker = client, reader, worker
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._read, name="shardkit-service-stream", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        metrics.inc("shardkit_service_queue_depth")  # before the put: the consumer may take it at once
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        metrics.inc("shardkit_service_queue_depth", -1)
        return False

    def _read(self) -> None:
        try:
            while not self._closed.is_set():
                try:
                    chunk = self._reader.read_chunk()
                except StopIteration:
                    self._put(_END)
                    return
                if not self._put(decode_batch(chunk.data, chunk.app_metadata)):
                    return
        except Exception as err:  # noqa: BLE001 - handed to the consuming thread, which decides
            self._put(err)

    def messages(self, deadline: float) -> Iterator[tuple[dict[str, Any], dict[str, Any], bool]]:
        """(arrays, state after them, last) per message.

        Raises:
            StreamBroken: the stream failed, or no message came within `deadline` seconds.
            ValueError, PermissionError: the worker refused the request (see `refusal`).
        """
        while True:
            asked = time.perf_counter()
            try:
                item = self._queue.get(timeout=deadline)
            except queue.Empty:
                raise StreamBroken(f"no batch from the worker within {deadline:g} s", worker=self.worker) from None
            finally:
                metrics.inc("shardkit_service_wait_seconds_total", time.perf_counter() - asked)
            metrics.inc("shardkit_service_queue_depth", -1)
            if item is _END:
                return
            if isinstance(item, BaseException):
                refused = refusal(item)
                if refused is not None:
                    raise refused from None
                if isinstance(item, ValueError) and "service message" in str(item):
                    raise item
                raise StreamBroken(str(item).splitlines()[0] if str(item) else type(item).__name__,
                                   worker=self.worker) from None
            yield item

    def close(self) -> None:
        self._closed.set()
        try:
            self._reader.cancel()
        except Exception:  # noqa: BLE001 - a stream already broken has nothing to cancel
            pass
        self._thread.join(timeout=5)
        self._client.close()
        metrics.inc("shardkit_service_queue_depth", -self._queue.qsize())  # read ahead, never handed out
