"""The step channel's wire (workers/step_channel.py) without Ray: a server on loopback serving fake
``execute`` / ``count`` callables on a thread, a client with the secret and one without."""

from __future__ import annotations

import socket
import threading

import pytest
from pagedray.workers import step_channel as sc


def _serving(execute, count=lambda: 0):
    server = sc.StepChannelServer("127.0.0.1", execute, count)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    return server, thread


def _ask(conn, payload: bytes) -> bytes:
    sc.write_message(conn, payload)
    return sc.read_message(conn)


def test_replies_to_plans_counts_and_worker_errors_until_the_client_closes():
    def execute(data: bytes):
        if data == b"boom":
            raise ValueError("running: unknown seq_id 7")
        return None if data == b"rank1" else data[::-1]

    server, thread = _serving(execute, count=lambda: 3)
    conn = sc.connect("127.0.0.1", server.port, server.secret, timeout_s=30)
    try:
        assert _ask(conn, b"plan-bytes") == sc.OK + b"setyb-nalp"
        assert _ask(conn, b"rank1") == sc.NONE
        assert _ask(conn, b"boom") == sc.ERROR + b"ValueError: running: unknown seq_id 7"
        assert _ask(conn, sc.COUNT) == sc.OK + sc.COUNT_FORMAT.pack(3)
        big = bytes(range(256)) * 20000                      # several recv calls per message
        assert _ask(conn, big) == sc.OK + big[::-1]
    finally:
        conn.close()
    thread.join(timeout=30)
    assert not thread.is_alive()                             # the client closed: serve returned


def test_a_client_without_the_secret_is_dropped_and_the_rank_keeps_listening():
    server, thread = _serving(lambda data: data)
    intruder = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sc.write_message(intruder, b"x" * sc.SECRET_BYTES)
    assert intruder.recv(1) == b""                           # closed without an answer
    intruder.close()
    conn = sc.connect("127.0.0.1", server.port, server.secret, timeout_s=30)
    try:
        assert _ask(conn, b"ok") == sc.OK + b"ok"
    finally:
        conn.close()
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_a_connection_closed_mid_message_is_an_error_and_a_closed_listener_ends_serve():
    left, right = socket.socketpair()
    left.sendall(sc.HEADER.pack(10) + b"abc")
    left.close()
    with pytest.raises(ConnectionError, match="mid-message"):
        sc.read_message(right)
    right.close()
    server, thread = _serving(lambda data: data)
    server.close()                                           # the actor is shutting down before a client came
    thread.join(timeout=30)
    assert not thread.is_alive()
