"""`pagedray serve --num-replicas 2` as a newcomer runs it (private Ray), then SIGTERM (issue #32).

Both engine replicas must come up: /metrics shows one ``pagedray:engine_healthy`` series per engine replica
(the private Ray declares a logical CPU for each replica's and TP rank's bundle; it had declared enough for
one replica only, and the second waited forever while /health said 200). SIGTERM is then handled like
Ctrl-C: exit status 0, the CLI says it stops with nothing in flight (the fast path: the private Ray is torn
down without waiting out Serve's shutdown loops), and every process of the CLI's tree (Ray's GCS, raylet,
dashboard, Serve's controller and proxy, the replicas, the TP workers) is gone.

Runs the real CLI in a subprocess; the time limits only end a hang (the exit time is measured by hand:
docs/reliability.md reports it). Slow: two replicas load the model on 2 cores (~1-2 minutes); the fast tests of
the same logic are in tests/deploy/test_cli_and_config.py (CPU count, the shutdown paths).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest
from test_cli_serve_failure import free_port

pytestmark = pytest.mark.integration   # starts Ray, Serve or a process (tests/conftest.py)

HANG_GUARD_S = 300


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status, response.read().decode()
    except OSError:
        return 0, ""


def _wait_for(what: str, ready, server: subprocess.Popen, log_path) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not ready():
        assert server.poll() is None, log_path.read_text()[-4000:]
        assert time.monotonic() < deadline, f"no {what} within the hang guard:\n" + log_path.read_text()[-4000:]
        time.sleep(1)


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root] + root.children(recursive=True)


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """The processes still running (a zombie waiting for init to reap it holds nothing)."""
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.slow
def test_two_replicas_serve_and_sigterm_stops_the_whole_tree(default_model_path, tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_DASHBOARD_ADDRESS")}
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        # run as the program (``python -m``), as the console script runs it: the exit path is the user's
        server = subprocess.Popen([sys.executable, "-u", "-m", "pagedray.deploy.cli.main", "serve",
                                   "--model", str(default_model_path), "--port", str(port), "--num-replicas", "2"],
                                  stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    tree: list[psutil.Process] = []
    try:
        _wait_for("/health 200", lambda: _get(url + "/health")[0] == 200, server, log_path)
        _wait_for("two engine replicas in /metrics",
                  lambda: _get(url + "/metrics")[1].count("pagedray:engine_healthy{") == 2, server, log_path)
        tree = _tree(server.pid)
        assert len(tree) >= 6, tree   # the CLI, Ray's processes, the controller, the replicas, the TP workers
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=HANG_GUARD_S) == 0, log_path.read_text()[-4000:]
        output = log_path.read_text()
        assert "stopping ..." in output and "nothing in flight: stopping Ray" in output, output[-4000:]
        deadline = time.monotonic() + HANG_GUARD_S
        while _alive(tree) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _alive(tree) == [], [(p.pid, p.name()) for p in _alive(tree)]
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=HANG_GUARD_S)
            except subprocess.TimeoutExpired:
                server.kill()
        for process in _alive(tree):   # only this test's own CLI tree
            process.kill()
