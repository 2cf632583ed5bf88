"""loopback.py (the replica gRPC bind hook) and benchmarks/listening_sockets.py (the /proc reader the
loopback test and the red team use), on this process's own sockets."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from pagedray.deploy.serve.loopback import is_loopback, loopback_grpc_port_binder

from benchmarks.listening_sockets import listening_sockets

pytestmark = pytest.mark.integration   # starts Ray, Serve or a process (tests/conftest.py)


def test_the_binder_moves_only_the_any_address_port_0_and_only_on_a_loopback_node():
    calls = []

    def add_port(server, address):
        calls.append((server, address))
        return 4242

    binder = loopback_grpc_port_binder(add_port, "127.0.0.1")
    assert binder("s", "[::]:0") == 4242 and binder("s", "10.1.2.3:50051") == 4242
    assert calls == [("s", "127.0.0.1:0"), ("s", "10.1.2.3:50051")]
    assert binder.wrapped is add_port
    assert loopback_grpc_port_binder(add_port, "192.0.2.2") is add_port     # a routable node: untouched
    assert is_loopback("::1") and is_loopback("localhost") and not is_loopback("0.0.0.0")


def _listener(family, host):
    sock = socket.socket(family)
    sock.bind((host, 0))
    sock.listen()
    return sock


def test_the_listening_sockets_of_a_process_tree_are_found_and_classified():
    loop, anywhere, anywhere6 = (_listener(socket.AF_INET, "127.0.0.1"), _listener(socket.AF_INET, "0.0.0.0"),
                                 _listener(socket.AF_INET6, "::"))
    child = subprocess.Popen([sys.executable, "-c", "import socket, sys; s = socket.socket(); "
                              "s.bind(('127.0.0.1', 0)); s.listen(); print(s.getsockname()[1], flush=True); "
                              "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child_port = int(child.stdout.readline())
        found = {(address, port) for address, port, _, _ in listening_sockets(os.getpid())}
        assert ("127.0.0.1", loop.getsockname()[1]) in found
        assert ("0.0.0.0", anywhere.getsockname()[1]) in found and ("::", anywhere6.getsockname()[1]) in found
        assert ("127.0.0.1", child_port) in found                           # a descendant's socket
        public = {port for address, port, _, _ in listening_sockets(os.getpid()) if not is_loopback(address)}
        assert anywhere.getsockname()[1] in public and anywhere6.getsockname()[1] in public
        assert loop.getsockname()[1] not in public and child_port not in public
    finally:
        child.stdin.close()
        child.wait()
        for sock in (loop, anywhere, anywhere6):
            sock.close()
    assert is_loopback("127.0.0.5") and is_loopback("::1")
    assert is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("0.0.0.0") and not is_loopback("::")
    assert not is_loopback("::ffff:192.0.2.2")
