"""The step channel: plans and results between the engine and one TP rank over a TCP connection of their
own, beside Ray (``ParallelConfig.ray_transport="socket"``).

A plain Ray actor call costs the engine's process CPU to submit and a round trip per step
(docs/design/workers.md); a compiled graph is faster but its reader spins. Here the rank serves
``execute_bytes`` from one long actor call (``RayWorker.serve_step_channel``) that blocks on the
socket, and the engine blocks on the reply: no spinning on either side, and Ray stays in charge of the
actor's life (creation, health pings, kill).

Wire: each message is an 8-byte big-endian length and that many bytes. The engine's first message is
the secret the rank handed out through Ray (``StepChannelServer.secret``); a connection that sends
anything else is closed and the rank keeps listening, so no other process on the network can drive
the rank. Then the engine sends plan bytes (``encode_plan``) and the rank answers each with one status
byte and a payload: ``OK`` + result bytes, ``NONE`` (a rank that samples nothing), or ``ERROR`` + the
worker's exception as text (``"TypeName: message"``). The connection closing means the rank (or the
engine) is gone.

Threads: the rank's steps run on the actor's main thread, inside the long ``serve_step_channel`` call
(torch's GEMMs ran slower on a thread of their own); ``num_sequences`` goes over the channel too, and
the executor watches the serving call instead of pinging a rank whose main thread is busy.
"""

from __future__ import annotations

import secrets
import socket
import struct
from collections.abc import Callable

HEADER = struct.Struct(">Q")
COUNT_FORMAT = struct.Struct(">Q")
OK, NONE, ERROR = b"\x00", b"\x01", b"\x02"
COUNT = b"\x03"
MAX_MESSAGE_BYTES = 1 << 30
SECRET_BYTES = 32


def write_message(conn: socket.socket, payload: bytes) -> None:
    conn.sendall(HEADER.pack(len(payload)) + payload)


def read_message(conn: socket.socket) -> bytes | None:
    """The next message, or None when the peer closed the connection before one began."""
    header = _read_exactly(conn, HEADER.size, allow_eof=True)
    if header is None:
        return None
    (length,) = HEADER.unpack(header)
    if length > MAX_MESSAGE_BYTES:
        raise ConnectionError(f"step channel: a message of {length} bytes (at most {MAX_MESSAGE_BYTES})")
    return _read_exactly(conn, length, allow_eof=False)


def _read_exactly(conn: socket.socket, size: int, allow_eof: bool) -> bytes | None:
    chunks, got = [], 0
    while got < size:
        chunk = conn.recv(min(size - got, 1 << 20))
        if not chunk:
            if allow_eof and got == 0:
                return None
            raise ConnectionError("step channel: the peer closed the connection mid-message")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def connect(host: str, port: int, secret: bytes, timeout_s: float) -> socket.socket:
    """The engine's end: connected, authenticated, Nagle off (one small message per step)."""
    conn = socket.create_connection((host, port), timeout=timeout_s)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    write_message(conn, secret)
    return conn


class StepChannelServer:
    """Listens on ``host`` (``port``); ``serve`` (blocking) answers the first client that presents
    ``secret``, one message at a time: plan bytes with ``execute(plan) -> result bytes or None``,
    ``COUNT`` with ``count()``. It returns when that client closes the connection or ``close`` is called."""

    def __init__(self, host: str, execute: Callable[[bytes], bytes | None], count: Callable[[], int]) -> None:
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self._execute = execute
        self._count = count
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]

    def _accept(self) -> socket.socket | None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:              # the listener was closed
                return None
            try:
                conn.settimeout(30.0)    # for the secret only
                if secrets.compare_digest(read_message(conn) or b"", self.secret):
                    conn.settimeout(None)
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    return conn
            except (OSError, ConnectionError):
                pass
            conn.close()

    def serve(self) -> None:
        conn = self._accept()
        self.close()
        if conn is None:
            return
        with conn:
            while True:
                try:
                    data = read_message(conn)
                except (OSError, ConnectionError):
                    return
                if data is None:
                    return
                try:
                    write_message(conn, self._answer(data))
                except OSError:
                    return

    def _answer(self, data: bytes) -> bytes:
        try:
            if data == COUNT:
                return OK + COUNT_FORMAT.pack(self._count())
            result = self._execute(data)
            return NONE if result is None else OK + result
        except Exception as exc:  # the worker's own error: the engine decides what it means
            return ERROR + f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")

    def close(self) -> None:
        """Stops listening; a ``serve`` still waiting for its client returns."""
        try:
            self._listener.shutdown(socket.SHUT_RDWR)   # wakes a blocked accept (close alone does not)
        except OSError:
            pass                                        # not listening any more
        self._listener.close()
