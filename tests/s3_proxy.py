"""A counting HTTP proxy in front of the moto S3 server: counts real GET requests per object key."""

from __future__ import annotations

import collections
import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "te", "trailer"}


class CountingProxy:
    """Forwards every request to `target` (http://host:port) and counts (method, path)."""

    def __init__(self, target: str):
        parsed = urlsplit(target)
        self.counts: collections.Counter = collections.Counter()
        self.bytes_out: collections.Counter = collections.Counter()
        lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                conn.request(self.command, self.path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
                conn.close()
                path = urlsplit(self.path).path
                with lock:
                    proxy.counts[(self.command, path)] += 1
                    if self.command == "GET":
                        proxy.bytes_out[path] += len(data)
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in _HOP and key.lower() != "content-length":
                        self.send_header(key, value)
                # A HEAD's answer has no body: its Content-Length is the object's size, passed on as it came.
                length = response.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def gets(self, suffix: str = "") -> dict[str, int]:
        """GET count per path ending with `suffix`."""
        return {path: n for (method, path), n in self.counts.items() if method == "GET" and path.endswith(suffix)}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
