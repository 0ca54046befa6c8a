"""A fault-injecting HTTP proxy for S3 tests, on loopback only.

`FaultProxy` sits between s3fs (pointed at it with `endpoint_url`) and moto's S3 server. Each request
is forwarded to moto, and with probability `rate` one fault is injected instead of (or into) the
normal answer:

    error500   500 InternalError XML, the request never reaches moto
    error503   503 ServiceUnavailable XML, never reaches moto
    slowdown   503 SlowDown throttling XML, never reaches moto
    reset      the TCP connection is reset (RST), before or after moto applied the request
    truncate   a GET body cut short: Content-Length promises more bytes than are sent
    slow       the answer is delayed by `slow_seconds` (then correct)
    flip       one bit of a GET body flipped (Content-Length and headers intact)

Decisions are seeded per request, not per arrival order: the random stream of a request is a
function of (seed, method, path, query, Range header, how many times that same request was seen),
so the same client workload gets the same faults whatever the thread interleaving (the bucket name,
signatures and upload ids are left out of the key: they change from run to run). `counts` says
what was injected; `log` lists (kind, method, path).
"""

from __future__ import annotations

import hashlib
import http.client
import random
import socket
import struct
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlsplit

FAULT_KINDS = ("error500", "error503", "slowdown", "reset", "truncate", "slow", "flip")
# Faults that change the bytes of a successful GET body; the rest apply to any request.
_BODY_FAULTS = {"truncate", "flip"}
# Hop-by-hop headers are never forwarded; the proxy re-frames bodies with Content-Length.
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                "proxy-connection", "expect"}

_ERROR_XML = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
              '<RequestId>fault-proxy</RequestId></Error>')
_ERRORS = {
    "error500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "error503": (503, "ServiceUnavailable", "Service is unable to handle request."),
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
}


class FaultProxy:
    """A threaded loopback proxy in front of `upstream` (http://127.0.0.1:PORT) that injects faults.

    Args:
        upstream: base URL of the real S3 endpoint (moto).
        rate: probability that a request gets a fault (0 disables injection).
        seed: seed of the per-request decisions.
        kinds: fault kinds to draw from (uniformly among those that apply to the request).
        slow_seconds: delay of a `slow` fault.
    """

    def __init__(self, upstream: str, *, rate: float = 0.0, seed: int = 0,
                 kinds: tuple[str, ...] = FAULT_KINDS, slow_seconds: float = 0.2):
        parts = urlsplit(upstream)
        if parts.hostname not in ("127.0.0.1", "localhost"):
            raise ValueError(f"FaultProxy only fronts a loopback endpoint, got {upstream!r}")
        self.upstream = (parts.hostname, parts.port)
        self.slow_seconds = slow_seconds
        self._lock = threading.Lock()
        self.configure(rate=rate, seed=seed, kinds=kinds)
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()

    def configure(self, *, rate: float | None = None, seed: int | None = None,
                  kinds: tuple[str, ...] | None = None, first_only: bool = False) -> None:
        """Change the fault plan and reset the counters and the per-request history.

        `first_only`: fault only the first of the repeated requests for one object (and range), so
        that a reader that repeats a request sees exactly one fault.
        """
        with self._lock:
            self.first_only = first_only
            if rate is not None:
                if not 0 <= rate <= 1:
                    raise ValueError(f"rate must be in [0, 1], got {rate}")
                self.rate = rate
            if seed is not None:
                self.seed = seed
            if kinds is not None:
                unknown = set(kinds) - set(FAULT_KINDS)
                if unknown or not kinds:
                    raise ValueError(f"unknown fault kinds {sorted(unknown)}; choose from {FAULT_KINDS}")
                self.kinds = tuple(kinds)
            self.counts: Counter[str] = Counter()
            self.log: list[tuple[str, str, str]] = []
            # (method, object key, User-Agent, status) of every request moto answered (storm tests
            # tell simulated nodes apart by a User-Agent suffix).
            self.answered: list[tuple[str, str, str, int]] = []
            self._seen: Counter[tuple] = Counter()

    @property
    def injected(self) -> int:
        """Number of faults injected since the last `configure`."""
        with self._lock:
            return sum(v for k, v in self.counts.items() if k in FAULT_KINDS)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- decisions -------------------------------------------------------------------------------
    def _plan(self, method: str, target: str, range_header: str | None) -> tuple[random.Random, str | None]:
        key = (method, _stable_target(target), range_header or "")
        with self._lock:
            self._seen[key] += 1
            nth = self._seen[key]
            self.counts["requests"] += 1
            self.counts[f"requests_{method}"] += 1
            rate, seed, kinds = self.rate, self.seed, self.kinds
            if self.first_only and nth > 1:
                rate = 0.0
        digest = hashlib.sha256(repr((seed, key, nth)).encode()).digest()
        rng = random.Random(int.from_bytes(digest[:8], "little"))
        if rng.random() >= rate:
            return rng, None
        return rng, rng.choice(kinds)

    def _record(self, kind: str, method: str, target: str) -> None:
        with self._lock:
            self.counts[kind] += 1
            self.log.append((kind, method, target))


def _stable_target(target: str) -> str:
    """The request target without what changes from run to run: the bucket (tests make fresh
    random buckets), signatures and dates of presigned URLs, multipart upload ids."""
    parts = urlsplit(target)
    key = parts.path.lstrip("/").partition("/")[2]
    query = sorted((name, "" if name.lower().startswith("x-amz-") or name == "uploadId" else value)
                   for name, value in parse_qsl(parts.query, keep_blank_values=True))
    return f"{key}?{query}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: FaultProxy

    def log_message(self, format, *args):  # noqa: A002 - stdlib signature; keep the proxy quiet
        pass

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _reset(self) -> None:
        # SO_LINGER with a zero timeout makes close() send RST: the client sees "connection reset".
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()

    def _send(self, status: int, reason: str, headers: list[tuple[str, str]], body: bytes,
              *, declared: int | None = None, head: bool = False) -> None:
        self.send_response_only(status, reason)
        for name, value in headers:
            if name.lower() not in _HOP_HEADERS and name.lower() != "content-length":
                self.send_header(name, value)
        if head:
            length = next((v for n, v in headers if n.lower() == "content-length"), None)
            if length is not None:
                self.send_header("Content-Length", length)
        else:
            self.send_header("Content-Length", str(len(body) if declared is None else declared))
        self.end_headers()
        if not head:
            self.wfile.write(body)
        self.wfile.flush()

    def _handle(self) -> None:
        owner = self.owner
        method = self.command
        body = self._read_body()
        rng, kind = owner._plan(method, self.path, self.headers.get("Range"))
        if kind in _BODY_FAULTS and method != "GET":  # draw again among the faults that apply, if any
            others = [k for k in owner.kinds if k not in _BODY_FAULTS]
            kind = rng.choice(others) if others else None
        if kind in _ERRORS:
            owner._record(kind, method, self.path)
            status, code, message = _ERRORS[kind]
            xml = _ERROR_XML.format(code=code, message=message).encode()
            headers = [("Content-Type", "application/xml"), ("Content-Length", str(len(xml)))]
            self._send(status, "Fault", headers, xml, head=method == "HEAD")
            return
        if kind == "reset" and rng.random() < 0.5:  # reset before the server saw the request
            owner._record(kind, method, self.path)
            self._reset()
            return
        if kind == "slow":
            owner._record(kind, method, self.path)
            time.sleep(owner.slow_seconds)
        upstream = http.client.HTTPConnection(*owner.upstream, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
            if body or method in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            upstream.request(method, self.path, body=body or None, headers=headers)
            response = upstream.getresponse()
            data = response.read()
            status, reason, out_headers = response.status, response.reason, response.getheaders()
        finally:
            upstream.close()
        with owner._lock:
            owner.answered.append((method, urlsplit(self.path).path.lstrip("/").partition("/")[2],
                                   self.headers.get("User-Agent", ""), status))
        if kind == "reset":  # after the server applied it: the client cannot know it succeeded
            owner._record(kind, method, self.path)
            self._reset()
            return
        head = method == "HEAD"
        if kind in _BODY_FAULTS and (status >= 300 or len(data) < 2):
            kind = None  # nothing to corrupt: answer normally
        if kind == "truncate":
            owner._record(kind, method, self.path)
            cut = rng.randrange(0, len(data))
            self._send(status, reason, out_headers, data[:cut], declared=len(data))
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if kind == "flip":
            owner._record(kind, method, self.path)
            buf = bytearray(data)
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
            data = bytes(buf)
        self._send(status, reason, out_headers, data, head=head)

    def do_GET(self):
        self._handle()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET


def through_proxy(options: dict, *, checksums: bool = True, botocore_attempts: int = 1) -> dict:
    """Storage options for the proxy: botocore retries `botocore_attempts` times in all (1: every fault
    reaches shardkit's own retry layer); without `checksums` botocore does not validate response
    checksums, as on stores that send none and for every ranged read, so flipped bodies reach shardkit."""
    config = {"retries": {"mode": "standard", "total_max_attempts": botocore_attempts}}
    if not checksums:
        config["response_checksum_validation"] = "when_required"
    return {**options, "config_kwargs": config}
