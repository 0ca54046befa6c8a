"""The dispatcher: which workers are alive and how busy, and to which one a consumer's next stream goes.

It holds no consumer position (the consumers' states are the truth), so a restarted dispatcher loses nothing:
workers register again at their next heartbeat, consumers retry until it answers. Workers join and leave at any
time; one that misses heartbeats for `stale_seconds` gets no new stream.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from shardkit import metrics
from shardkit.loaders.sources.service.wire import decode_object
from shardkit.serve.security import middleware
from shardkit.serve.worker import json_result, refused

logger = logging.getLogger(__name__)


@dataclass
class WorkerRecord:
    """A registered worker: where it serves, what, and its load at its last heartbeat."""

    location: str
    identity: str
    pid: int | None
    seen: float
    load: dict[str, int] = field(default_factory=dict)
    routed: int = 0  # streams sent to it since its last heartbeat (its load until it reports them)


class Dispatcher(flight.FlightServerBase):
    """The dispatcher at `location` (grpc://HOST:PORT)."""

    def __init__(self, *, location: str, token: str | None, stale_seconds: float = 3.0):
        super().__init__(location, middleware=middleware(token))
        self.stale_seconds = stale_seconds
        self._lock = threading.Lock()
        self._workers: dict[str, WorkerRecord] = {}
        self._description: dict[str, Any] | None = None
        self._next_id = 0
        self.routes = 0

    def _body(self, action: flight.Action) -> dict[str, Any]:
        try:
            return decode_object(action.body.to_pybytes(), what=f"{action.type} request")
        except ValueError as err:
            raise refused(str(err)) from None

    def do_action(self, context: Any, action: flight.Action) -> list[flight.Result]:
        handlers = {"register": self._register, "heartbeat": self._heartbeat, "describe": self._describe,
                    "workers": self._list, "leave": self._leave}
        handler = handlers.get(action.type)
        if handler is None:
            raise refused(f"unknown action {action.type!r} (the dispatcher answers {', '.join(sorted(handlers))})")
        return json_result(handler(self._body(action)))

    def list_actions(self, context: Any) -> list[tuple[str, str]]:
        return [("register", "a worker joins"), ("heartbeat", "a worker's load"), ("describe", "the data served"),
                ("workers", "the live workers"), ("leave", "a worker leaves")]

    def _register(self, body: dict[str, Any]) -> dict[str, Any]:
        description, location = body.get("description"), body.get("location")
        if not isinstance(description, dict) or not isinstance(description.get("identity"), str) \
                or not isinstance(location, str):
            raise refused("register: needs location and description (a shardkit serve worker)")
        with self._lock:
            if self._description is not None and description["identity"] != self._description["identity"]:
                raise refused(f"register: this service serves {self._description['describe']}, the worker at "
                              f"{location} serves {description['describe']}")
            self._description = description
            worker_id = body.get("id") if isinstance(body.get("id"), str) else f"w{self._next_id}"
            self._next_id += 1
            self._workers[worker_id] = WorkerRecord(location=location, identity=description["identity"],
                                                    pid=body.get("pid"), seen=time.monotonic())
        logger.info("worker %s joined at %s", worker_id, location)
        return {"id": worker_id}

    def _heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            record = self._workers.get(body.get("id"))
            if record is None:
                return {"known": False}  # a restarted dispatcher: the worker registers again
            record.seen, record.routed = time.monotonic(), 0
            load = body.get("load")
            sent = _rows(load) - _rows(record.load)
            record.load = load if isinstance(load, dict) else {}
        if sent > 0:
            metrics.inc("shardkit_service_worker_rows_total", sent, worker=body["id"])
        return {"known": True}

    def _leave(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            gone = self._workers.pop(body.get("id"), None)
        return {"left": gone is not None}

    def _describe(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self._description is None or not self._live():
                raise flight.FlightUnavailableError("no worker has joined yet")
            return self._description

    def _live(self) -> dict[str, WorkerRecord]:
        now = time.monotonic()
        return {wid: r for wid, r in self._workers.items() if now - r.seen <= self.stale_seconds}

    def _list(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            return {"workers": [{"id": wid, "location": r.location, "pid": r.pid, "load": r.load}
                                for wid, r in sorted(self._live().items())]}

    def get_flight_info(self, context: Any, descriptor: flight.FlightDescriptor) -> flight.FlightInfo:
        """Route a consumer's next streams: up to `workers` (default 1) distinct live workers, least loaded first,
        outside its `exclude` list (workers it saw fail), or any live ones when all are excluded. A consumer
        reading a step in parts opens one stream per endpoint (`sources.service.parts`)."""
        try:
            request = decode_object(descriptor.command or b"{}", what="route request")
        except ValueError as err:
            raise refused(str(err)) from None
        exclude, wanted = request.get("exclude", []), request.get("workers", 1)
        if not isinstance(exclude, list):
            raise refused("route request: exclude must be a list of worker ids")
        if isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 1:
            raise refused(f"route request: workers must be an integer >= 1, got {wanted!r}")
        with self._lock:
            live = self._live()
            candidates = {wid: r for wid, r in live.items() if wid not in exclude} or live
            if not candidates:
                raise flight.FlightUnavailableError("no live worker (starting, or all gone: the consumer waits)")
            chosen = sorted(candidates, key=lambda wid: (candidates[wid].load.get("streams", 0)
                                                         + candidates[wid].routed, wid))[:wanted]
            for worker_id in chosen:
                candidates[worker_id].routed += 1
            self.routes += 1
        endpoints = [flight.FlightEndpoint(wid.encode(), [flight.Location(candidates[wid].location)])
                     for wid in chosen]
        return flight.FlightInfo(pa.schema([]), descriptor, endpoints, -1, -1)


def run_heartbeats(server: Any, *, dispatcher: str, advertised: str, token: str | None, stop: threading.Event,
                   interval: float = 0.5) -> None:
    """A worker's membership: register with the dispatcher, then report its load every `interval` seconds
    (registering again after a dispatcher restart) until `stop`."""
    from shardkit.loaders.sources.service.client import call_options

    worker_id: str | None = None
    client = None
    while not stop.is_set():
        try:
            client = client or flight.FlightClient(dispatcher)
            options = call_options(token, timeout=5)
            if worker_id is None:
                body = {"location": advertised, "description": server.description, "pid": _pid()}
                worker_id = _answer(client, "register", body, options)["id"]
            elif not _answer(client, "heartbeat", {"id": worker_id, "load": server.load()}, options)["known"]:
                worker_id = None
                continue
        except (pa.ArrowException, OSError) as err:
            logger.debug("dispatcher %s unreachable: %s", dispatcher, err)
            client = None
        stop.wait(interval)


def _answer(client: Any, name: str, body: dict[str, Any], options: Any) -> dict[str, Any]:
    results = list(client.do_action(flight.Action(name, json.dumps(body).encode()), options))
    return json.loads(results[0].body.to_pybytes())


def _pid() -> int:
    import os

    return os.getpid()


def _rows(load: Any) -> int:
    """The rows a worker's load report says it sent so far (0 for a malformed report)."""
    rows = load.get("rows") if isinstance(load, dict) else None
    return rows if isinstance(rows, int) and not isinstance(rows, bool) else 0
