"""Free TCP ports on loopback (one: ``pagedray.deploy.cli.main.free_port``)."""

from __future__ import annotations

import socket

from pagedray.deploy.cli.main import free_port

__all__ = ["free_port", "free_ports"]


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free at the moment of the call (all held open until every one is found)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
