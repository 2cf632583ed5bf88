"""CI smoke test of the YAML path: ``ray start --head`` -> ``serve deploy deploy/serve/serve.yaml`` -> one
request -> ``serve shutdown -y`` -> stop the cluster.

The cluster is private to this test: loopback only, its own temp dir, free ports for everything
(GCS, dashboard, agents, client server, metrics), so it neither collides with nor joins the test
session's Ray instance or anyone else's on the machine.

Stopping: ``ray stop`` kills *every* Ray process on the machine by process name (other users'
clusters and this test session's own Ray included), so it is not used. The head is started with
``--block`` instead and stopped by sending SIGTERM to that one process, which tears down exactly the
processes it started; any process still alive with our temp dir in its command line is then killed
by pid.

The deployed file is deploy/serve/serve.yaml with only the HTTP port (a free one) and a smaller KV cache
(``num_blocks``) changed; everything else (import path, default model, 127.0.0.1) is as shipped.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import psutil
import pytest
import yaml
from helpers.ports import free_ports

# slow: the extended tier (README: -m slow); CI keeps .ci/serve_smoke, which deploys serve.yaml as the README says
pytestmark = [pytest.mark.integration, pytest.mark.slow]   # starts Ray, Serve or a process

REPO = pathlib.Path(__file__).resolve().parents[2]
YAML_PATH = REPO / "deploy" / "serve" / "serve.yaml"
BIN = pathlib.Path(sys.executable).parent
START_TIMEOUT_S = 120
DEPLOY_TIMEOUT_S = 300


def cli(name: str) -> str:
    path = BIN / name
    return str(path) if path.exists() else name


def clean_env() -> dict:
    """Environment of the cluster and CLI subprocesses: never pointed at another cluster, and with
    Ray token auth explicitly off (a loopback-only private cluster), so that the result does not
    depend on whether some earlier Ray run left a token file in the home folder (``ray start`` turns
    token auth on when it finds one, while the ``serve`` CLI only sends it in ``token`` mode)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_DASHBOARD_ADDRESS")}
    env["RAY_AUTH_MODE"] = "disabled"
    return env   # it carries LOCAL_RAY_ENV (proxy checks, worker niceness): tests/conftest.py sets it


def run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=clean_env())


class PrivateRayHead:
    def __init__(self) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="prd-e2e-", dir="/tmp")
        (self.gcs, self.dashboard, self.client, self.agent_http, self.agent_grpc, self.metrics,
         self.runtime_env, self.node_manager, self.object_manager, self.http) = free_ports(10)
        self.process: subprocess.Popen | None = None
        self.log = open(os.path.join(self.temp_dir, "ray-start.log"), "w")

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard}"

    def start(self) -> None:
        args = [cli("ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
                "--port", str(self.gcs), "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard),
                "--include-dashboard", "true", "--ray-client-server-port", str(self.client),
                "--dashboard-agent-listen-port", str(self.agent_http),
                "--dashboard-agent-grpc-port", str(self.agent_grpc), "--metrics-export-port", str(self.metrics),
                "--runtime-env-agent-port", str(self.runtime_env), "--node-manager-port", str(self.node_manager),
                "--object-manager-port", str(self.object_manager), "--temp-dir", self.temp_dir,
                "--num-cpus", "4", "--disable-usage-stats"]
        self.process = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=clean_env(),
                                        start_new_session=True)
        # the serve CLI (not a raw HTTP probe) so that the cluster's own auth settings are honoured
        self._wait_for(lambda: run([cli("serve"), "status", "-a", self.dashboard_url], 60).returncode == 0,
                       START_TIMEOUT_S, "the Ray dashboard")

    def _wait_for(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"ray start exited early ({self.process.returncode}): {self.tail()}")
            try:
                if ready():
                    return
            except (httpx.HTTPError, subprocess.TimeoutExpired):
                pass
            time.sleep(2.0)
        raise AssertionError(f"{what} not ready after {timeout_s} s: {self.tail()}")

    def tail(self) -> str:
        self.log.flush()
        return pathlib.Path(self.log.name).read_text()[-3000:]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        for proc in psutil.process_iter(["pid", "cmdline"]):
            try:
                if any(self.temp_dir in part for part in proc.info["cmdline"] or ()):
                    proc.kill()
            except psutil.Error:
                pass
        self.log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def write_config(head: PrivateRayHead) -> pathlib.Path:
    config = yaml.safe_load(YAML_PATH.read_text())
    assert config["http_options"]["host"] == "127.0.0.1"
    config["http_options"]["port"] = head.http
    config["applications"][0]["args"].update({"num_blocks": 64, "max_model_len": 512})
    path = pathlib.Path(head.temp_dir) / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def ray_head(default_model_path):  # the model is fetched before the cluster starts
    head = PrivateRayHead()
    try:
        head.start()
        yield head
    finally:
        try:
            run([cli("serve"), "shutdown", "-y", "-a", head.dashboard_url], timeout=120)
        finally:
            head.stop()


def test_serve_deploy_yaml_answers_a_request(ray_head):
    deployed = run([cli("serve"), "deploy", str(write_config(ray_head)), "-a", ray_head.dashboard_url],
                   timeout=120)
    assert deployed.returncode == 0, deployed.stderr + deployed.stdout
    url = f"http://127.0.0.1:{ray_head.http}"
    ray_head._wait_for(lambda: httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200,
                       DEPLOY_TIMEOUT_S, "the Serve app")
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120, trust_env=False)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["text"] and choice["finish_reason"] in ("length", "stop")
    status = run([cli("serve"), "status", "-a", ray_head.dashboard_url], timeout=60)
    assert "RUNNING" in status.stdout, status.stdout + status.stderr
