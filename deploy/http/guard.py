"""Connection-level limits for the HTTP server that answers on ``--port``, and the API key on Serve's
own routes.

Serve starts the HTTP servers itself (its proxy, and with direct ingress a uvicorn inside the ingress
replica) and passes no header limits: uvicorn's default protocol is httptools, which takes headers of
any size and any duration. What Serve does let us change, and what pagedray changes:

1. ``BoundedH11Protocol``: uvicorn's h11 protocol with a bound on the request head (request line plus
   headers): past ``MAX_HEAD_BYTES`` it answers 431 and closes the connection, whether the head arrived
   whole or is still arriving; and a header-read deadline: a connection that has not sent a complete
   request head ``HEADER_TIMEOUT_S`` after it opened, or after its previous response ended, is closed
   (slowloris). ``use_bounded_protocol()``
   makes it uvicorn's ``http="auto"`` protocol in the calling process; the ingress replica calls it in
   its constructor, which Serve runs before it starts the replica's direct-ingress server.
2. ``serve_middlewares()``: an ASGI middleware for Serve's built-in ``/-/routes`` listing (answered by
   Serve before the app sees the request): 401 without ``Authorization: Bearer <key>`` when
   ``PAGEDRAY_API_KEY_SHA256`` (the key's SHA-256, hex) is set. ``pagedray serve --api-key`` sets it and
   ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` (Serve's hook for extra middlewares) for the Ray it
   starts. ``/-/healthz`` stays open like ``/health``: it says whether the replica is up, nothing more.

What remains (docs/limitations.md): on a Ray cluster that ``pagedray serve`` joins (``--address``)
the hook and the hash must be set in that cluster's environment; Serve's proxy, which in direct-ingress
mode listens on a free loopback port that nothing uses, keeps httptools.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..openai.errors import APIError, invalid_api_key

HEADER_TIMEOUT_S = 10.0
MAX_HEAD_BYTES = 64 * 1024
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024   # max_body_bytes' default: a larger body is a 413 (routes.py)
HEAD_END = b"\r\n\r\n"
TOO_LARGE_BODY = APIError(431, f"request headers are larger than {MAX_HEAD_BYTES} bytes",
                          code="headers_too_large").body_bytes()
TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
             b"connection: close\r\ncontent-length: " + str(len(TOO_LARGE_BODY)).encode() + b"\r\n\r\n"
             + TOO_LARGE_BODY)
KEY_HASH_ENV = "PAGEDRAY_API_KEY_SHA256"
MIDDLEWARE_HOOK = "pagedray.deploy.http.guard:serve_middlewares"
GUARDED_PATHS = ("/-/routes",)


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a deadline for each request head (see the module docstring)."""

    header_timeout_s = HEADER_TIMEOUT_S

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # h11's own bound on a still-incomplete head, above ours so that ours (431) answers first
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=2 * MAX_HEAD_BYTES)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_seen, self._head_tail = 0, b""
        self._header_deadline: asyncio.TimerHandle | None = None
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._head_too_long(data):
            self._cancel_header_deadline()
            self.transport.write(TOO_LARGE)
            self.transport.close()
            return
        super().data_received(data)

    def _head_too_long(self, data: bytes) -> bool:
        """Counts the bytes of the request head being received; True once it exceeds MAX_HEAD_BYTES."""
        scan = self._head_tail + data              # the end marker may straddle two reads
        end = scan.find(HEAD_END)
        if end >= 0:
            size = self._head_seen - len(self._head_tail) + end + len(HEAD_END)
            self._head_seen, self._head_tail = 0, b""
            return size > MAX_HEAD_BYTES
        self._head_seen += len(data)
        self._head_tail = scan[-(len(HEAD_END) - 1):]
        return self._head_seen > MAX_HEAD_BYTES

    def _arm_header_deadline(self) -> None:
        self._cancel_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._header_deadline_passed)

    def _cancel_header_deadline(self) -> None:
        if getattr(self, "_header_deadline", None) is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _header_deadline_passed(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()            # the request head did not arrive in time

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:   # a complete request head arrived
            self._cancel_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_deadline()       # the next request head on this connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)


def use_bounded_protocol() -> None:
    """Make ``BoundedH11Protocol`` uvicorn's ``http="auto"`` protocol in this process."""
    from uvicorn import config

    config.HTTP_PROTOCOLS["auto"] = f"{__name__}:BoundedH11Protocol"


def key_hash(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


class GuardServeRoutes:
    """ASGI middleware: ``GUARDED_PATHS`` need ``Authorization: Bearer <key>`` whose SHA-256 is
    ``expected_hash``; everything else passes through untouched."""

    def __init__(self, app, expected_hash: str) -> None:
        self.app = app
        self.expected_hash = expected_hash

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("path") in GUARDED_PATHS and not self._authorized(scope):
            error = invalid_api_key()
            headers = [(b"content-type", b"application/json")] + [
                (name.encode(), value.encode()) for name, value in error.headers.items()]
            await send({"type": "http.response.start", "status": error.status, "headers": headers})
            await send({"type": "http.response.body", "body": error.body_bytes()})
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(key_hash(token.strip()), self.expected_hash)


def serve_middlewares() -> list:
    """Serve's ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` hook: the guard when a key hash is set."""
    from starlette.middleware import Middleware

    expected = os.environ.get(KEY_HASH_ENV)
    return [Middleware(GuardServeRoutes, expected_hash=expected)] if expected else []


def guard_env(api_key: str | None) -> dict[str, str]:
    """Environment for a Ray started by ``pagedray serve``: the hook and the key's hash (none without a key)."""
    if not api_key:
        return {}
    return {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": MIDDLEWARE_HOOK, KEY_HASH_ENV: key_hash(api_key)}
