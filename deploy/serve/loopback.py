"""A Ray that ``pagedray serve`` starts itself listens on loopback only.

Ray chooses each server's bind address from the node IP: GCS, raylet, object manager, every worker's
gRPC server, the dashboard agent, the metrics exporters and the runtime-env agent bind 127.0.0.1 when
the node IP is 127.0.0.1, and all interfaces otherwise. On Linux, Ray rewrites a requested node IP of
127.0.0.1 to the host's address unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
(``ray._private.services.resolve_ip_for_localhost``, Ray 2.60), so the private Ray gets
``LOOPBACK_RAY_ENV`` and ``LOOPBACK_NODE_IP``. Its cost: no other node can join that Ray, which a private
single-host Ray never needs (``--address`` joins a cluster, whose settings are its own).

One server ignores the node IP: each Serve replica's inter-deployment gRPC server binds ``[::]:0``
(``ray.serve._private.replica``, Ray 2.60). ``bind_replica_grpc_to_loopback`` is called in the
constructors of pagedray's replicas, which Serve runs before it starts that server, and makes the
replica bind ``127.0.0.1:0`` instead, but only when this node's IP is loopback (then no peer could
reach another address anyway); with any other node IP it changes nothing. If a Ray release drops or
renames the hooked function, nothing changes and the listening-socket test
(tests/e2e/test_cli_loopback.py) fails.
"""

from __future__ import annotations

import ipaddress

LOOPBACK_NODE_IP = "127.0.0.1"
LOOPBACK_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}   # keeps a node IP of 127.0.0.1 as given
ANY_ADDRESS_PORT_0 = "[::]:0"


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1, an IPv4-mapped loopback address (``::ffff:127.0.0.1``) or ``localhost``."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address == "localhost"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def loopback_grpc_port_binder(add_port, node_ip: str):
    """``add_port(server, address)`` that binds ``127.0.0.1:0`` for ``[::]:0`` on a loopback node."""
    if not is_loopback(node_ip):
        return add_port

    def add_loopback_port(server, address: str, *args, **kwargs):
        if address == ANY_ADDRESS_PORT_0:
            address = f"{LOOPBACK_NODE_IP}:0"
        return add_port(server, address, *args, **kwargs)

    add_loopback_port.wrapped = add_port
    return add_loopback_port


def bind_replica_grpc_to_loopback() -> bool:
    """In a Serve replica on a loopback node: its inter-deployment gRPC server binds loopback.
    True when the hook is in place (idempotent)."""
    import ray
    from ray.serve._private import replica

    current = getattr(replica, "add_port_to_grpc_server", None)
    if current is None:
        return False
    if hasattr(current, "wrapped"):
        return True
    binder = loopback_grpc_port_binder(current, ray.util.get_node_ip_address())
    replica.add_port_to_grpc_server = binder
    return binder is not current
