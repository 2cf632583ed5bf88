"""`pagedray serve` with its private Ray listens on loopback only: every listening TCP socket of the
CLI's process tree (the CLI, GCS, raylet, dashboard and agents, the Serve controller and proxy, the
ingress and engine replicas, the TP worker) is on 127.0.0.0/8, ::1 or an IPv4-mapped loopback address.
The engine runs in a deployment of its own (``--no-engine-in-ingress``), so both of pagedray's replica
kinds are covered. Runs the real CLI in a subprocess; the time limits only end a hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from pagedray.deploy.serve.loopback import is_loopback
from test_cli_serve_failure import CLI, free_port

from benchmarks.listening_sockets import listening_sockets

pytestmark = pytest.mark.integration   # starts Ray, Serve or a process (tests/conftest.py)

HANG_GUARD_S = 900


def _get(url: str, body: dict | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=HANG_GUARD_S) as response:
            return response.status, response.read()
    except OSError:
        return 0, b""


def test_a_served_app_and_its_private_ray_listen_on_loopback_only(default_model_path, tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_DASHBOARD_ADDRESS")}
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen([sys.executable, "-c", CLI, "serve", "--model", str(default_model_path),
                               "--port", str(port), "--no-engine-in-ingress"],
                              stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + HANG_GUARD_S
        while _get(url + "/health")[0] != 200:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no /health within the hang guard"
            time.sleep(1)
        status, _ = _get(url + "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert status == 200                     # the ingress reached the engine replica over Serve
        sockets = listening_sockets(server.pid)
        names = {name for *_, name in sockets}
        assert any(p == port for _, p, _, _ in sockets), sockets        # the served port is seen
        assert len(sockets) >= 8 and "gcs_server" in names and "raylet" in names, sockets
        public = [s for s in sockets if not is_loopback(s[0])]
        assert public == [], public
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=HANG_GUARD_S)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
