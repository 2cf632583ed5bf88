"""The listening TCP sockets of a process tree, read from /proc (Linux; no ``ss`` or ``psutil`` needed).

``listening_sockets(root_pid)`` -> sorted ``[(address, port, pid, process name)]`` for every socket in
LISTEN state that a process of the tree (``root_pid`` and its descendants: a server and the Ray
processes it started) holds open; ``pagedray.deploy.serve.loopback.is_loopback`` tells loopback addresses
(IPv4-mapped ones included) from the rest (0.0.0.0 and :: included). Used by the red team's
open-surfaces case and by tests/e2e/test_cli_loopback.py.
"""

from __future__ import annotations

import os
import socket
import struct

LISTEN = "0A"


def process_tree(root_pid: int) -> dict[int, str]:
    """``{pid: name}`` of ``root_pid`` and all its descendants."""
    parents, names = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:        # the process ended while we looked
            continue
        name_end = stat.rindex(")")
        names[int(entry)] = stat[stat.index("(") + 1:name_end]
        parents[int(entry)] = int(stat[name_end + 2:].split()[1])
    tree, todo = {}, [root_pid]
    while todo:
        pid = todo.pop()
        if pid in names and pid not in tree:
            tree[pid] = names[pid]
            todo += [child for child, parent in parents.items() if parent == pid]
    return tree


def _address(hex_address: str) -> tuple[str, int]:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    # /proc/net/tcp* print each 32-bit word of the address in host (little-endian) order
    words = b"".join(struct.pack("<I", struct.unpack(">I", raw[i:i + 4])[0]) for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, words), int(port, 16)


def _listening_by_inode() -> dict[str, tuple[str, int]]:
    by_inode = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == LISTEN:
                by_inode[fields[9]] = _address(fields[1])
    return by_inode


def listening_sockets(root_pid: int) -> list[tuple[str, int, int, str]]:
    """Every LISTEN socket held by the tree of ``root_pid``: ``(address, port, pid, name)``, sorted."""
    by_inode = _listening_by_inode()
    found = set()
    for pid, name in process_tree(root_pid).items():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in by_inode:
                found.add((*by_inode[target[8:-1]], pid, name))
    return sorted(found)

