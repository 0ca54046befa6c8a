"""Who may talk to a service: loopback by default; any other address only with a shared token.

The token travels in each call's `authorization` header (`Bearer TOKEN`) and is compared in constant time by
a Flight server middleware, so a call without it is refused before any handler runs (no data flows). The token
comes from `--token` or `$SHARDKIT_SERVICE_TOKEN` and is never logged.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import socket
from typing import Any

import pyarrow.flight as flight

from shardkit.loaders.sources.service.client import TOKEN_ENV



def is_loopback(host: str) -> bool:
    """Whether `host` names only this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_binding(host: str, token: str | None) -> None:
    """Raises: ValueError: a non-loopback address without a token (one line, what to do)."""
    if not is_loopback(host) and not token:
        raise ValueError(f"--host {host} is reachable from other machines: give a shared token (--token or "
                         f"${TOKEN_ENV}) that consumers send too, or bind 127.0.0.1")


def advertised_host(host: str) -> str:
    """The name other machines reach a server bound to `host` by (a wildcard address is not one)."""
    return socket.getfqdn() if host in ("0.0.0.0", "::", "") else host


class TokenCheck(flight.ServerMiddlewareFactory):
    """Refuses every call that does not carry the shared token."""

    def __init__(self, token: str):
        super().__init__()
        self._expected = f"Bearer {token}".encode()

    def start_call(self, info: Any, headers: dict[str, list[Any]]) -> None:
        given = [v.encode() if isinstance(v, str) else bytes(v) for v in headers.get("authorization", [])]
        if not any(hmac.compare_digest(value, self._expected) for value in given):
            raise flight.FlightUnauthenticatedError("refused: this service needs its shared token (set "
                                                    f"${TOKEN_ENV} or service_token= on the consumer)")
        return None


def middleware(token: str | None) -> dict[str, Any]:
    return {"token": TokenCheck(token)} if token else {}


def token_from(given: str | None) -> str | None:
    return given or os.environ.get(TOKEN_ENV) or None
