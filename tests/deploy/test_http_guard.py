"""Connection limits of the protocol the ingress replica's HTTP server uses (``BoundedH11Protocol``, run
here in a real uvicorn server on a loopback socket) and the API key on Serve's ``/-/routes``.

No test races the clock: a deadline that must fire is tiny and the test waits (up to a minute) for the
close it causes; a deadline that must not fire is an hour long."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest
import uvicorn
from pagedray.deploy.http import guard as http_guard
from pagedray.deploy.http.guard import BoundedH11Protocol, GuardServeRoutes, guard_env, key_hash, serve_middlewares
from pagedray.deploy.openai.errors import invalid_api_key

HOUR = 3600.0


async def ok_app(scope, receive, send):
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


class Server:
    """uvicorn with ``protocol`` on 127.0.0.1:<free port>, in a thread with its own event loop."""

    def __init__(self, protocol) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.sock.listen(8)          # connections wait in the backlog until the server accepts them
        self.server = uvicorn.Server(uvicorn.Config(ok_app, http=protocol, lifespan="off", log_level="critical"))
        self.server.install_signal_handlers = lambda: None
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])))

    def __enter__(self) -> Server:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=60)


def read_until_closed(conn: socket.socket) -> bytes:
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    return data


def read_response(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"ok"):
        chunk = conn.recv(65536)
        assert chunk, f"connection closed after {data!r}"
        data += chunk
    return data


REQUEST = b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"


def protocol_with_deadlines(*seconds: float):
    """A BoundedH11Protocol whose n-th header deadline lasts ``seconds[n]`` (the last one repeats)."""
    armed = []

    class Protocol(BoundedH11Protocol):
        @property
        def header_timeout_s(self) -> float:
            armed.append(1)
            return seconds[min(len(armed), len(seconds)) - 1]

    return Protocol


def test_requests_and_keep_alive_are_served():
    with Server(protocol_with_deadlines(HOUR)) as server, server.connect() as conn:
        for _ in range(2):                      # two requests on one connection
            conn.sendall(REQUEST)
            assert read_response(conn).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("finished", [True, False])
def test_oversized_headers_are_refused_and_the_connection_closed(finished):
    head = b"GET / HTTP/1.1\r\nHost: a\r\nX-Big: " + b"a" * http_guard.MAX_HEAD_BYTES
    with Server(protocol_with_deadlines(HOUR)) as server, server.connect() as conn:
        conn.sendall(head + (b"\r\n\r\n" if finished else b""))    # whole, or still arriving
        reply = read_until_closed(conn)
    assert reply.startswith(b"HTTP/1.1 431") and b"headers_too_large" in reply


def test_a_head_just_under_the_limit_and_a_large_body_are_served():
    head = b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 200000\r\nX-Big: "
    head += b"a" * (http_guard.MAX_HEAD_BYTES - len(head) - 4) + b"\r\n\r\n"
    assert len(head) == http_guard.MAX_HEAD_BYTES
    with Server(protocol_with_deadlines(HOUR)) as server, server.connect() as conn:
        conn.sendall(head + b"b" * 200000)
        assert read_response(conn).startswith(b"HTTP/1.1 200")


def test_a_request_head_that_never_completes_is_closed():
    with Server(protocol_with_deadlines(0.05)) as server, server.connect() as conn:
        conn.sendall(b"GET / HTTP/1.1\r\nHost: a\r\n")      # no blank line: the head never ends
        assert read_until_closed(conn) == b""


def test_the_deadline_is_armed_again_for_the_next_request_on_a_connection():
    # first head: an hour (it arrives); after the response: 0.05 s for a head that never completes
    with Server(protocol_with_deadlines(HOUR, 0.05)) as server, server.connect() as conn:
        conn.sendall(REQUEST)
        assert read_response(conn).startswith(b"HTTP/1.1 200")
        conn.sendall(b"GET / HTTP/1.1\r\n")
        assert read_until_closed(conn) == b""


def test_use_bounded_protocol_replaces_uvicorns_auto_protocol(monkeypatch):
    from uvicorn import config

    monkeypatch.setitem(config.HTTP_PROTOCOLS, "auto", config.HTTP_PROTOCOLS["auto"])
    http_guard.use_bounded_protocol()
    loaded = uvicorn.Config(ok_app, lifespan="off")
    loaded.load()
    assert loaded.http_protocol_class is BoundedH11Protocol


def _call(app, path: str, authorization: str | None = None) -> tuple[int, bytes]:
    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    asyncio.run(app({"type": "http", "path": path, "headers": headers}, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_serve_routes_need_the_key_and_other_paths_pass():
    guard = GuardServeRoutes(ok_app, key_hash("sk-test"))
    status, body = _call(guard, "/-/routes")
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert json.loads(body) == invalid_api_key().body()          # the routes' 401, built in one place
    assert _call(guard, "/-/routes", "Bearer wrong")[0] == 401
    assert _call(guard, "/-/routes", "Bearer sk-test") == (200, b"ok")
    assert _call(guard, "/-/healthz") == (200, b"ok")
    assert _call(guard, "/v1/models") == (200, b"ok")      # the app checks its own routes


@pytest.mark.parametrize("api_key", [None, "sk-test"])
def test_guard_env_and_the_serve_hook(api_key, monkeypatch):
    env = guard_env(api_key)
    monkeypatch.delenv(http_guard.KEY_HASH_ENV, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    middlewares = serve_middlewares()
    if api_key is None:
        assert env == {} and middlewares == []
    else:
        assert env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == http_guard.MIDDLEWARE_HOOK
        assert "sk-test" not in "".join(env.values())           # only the hash travels
        (middleware,) = middlewares
        assert middleware.cls is GuardServeRoutes and middleware.kwargs == {"expected_hash": key_hash("sk-test")}
