"""``pagedray deploy CONFIG``: the README's deployment, one command that works on a fresh machine and on one
that already ran pagedray: ``ray start --head`` (unless ``--address`` names a running cluster), then ``serve
deploy CONFIG``, then a wait until the app answers ``/health`` on the YAML's ``http_options`` (or a replica
fails: the command exits 1 with ``serve status``'s report).

Why a wrapper (issue #68): Ray 2.60 authenticates with a token once ``~/.ray/auth_token`` exists (any earlier
``ray.init()`` writes it: ``pagedray serve``, ``LLM`` on Ray, the handle example), and ``ray start`` then
turns token auth on, which the ``serve`` CLI only follows when ``RAY_AUTH_MODE=token`` is set: without it
``serve deploy`` fails with "Missing authentication token". So every Ray CLI call here runs with
``RAY_AUTH_MODE=token`` (unless the environment sets a mode) after ``ray get-auth-token --generate`` (which
keeps an existing token). And ``serve deploy`` returns before the replicas are up, so a load test pasted
right after it would meet a refused connection: the wait makes the next line work.

Decisions:
- The cluster this starts keeps running after the command (as ``ray start`` + ``serve deploy`` do); ``serve
  shutdown -y && ray stop`` ends it. ``--address`` deploys onto a cluster that runs already.
- The Ray it starts gets the proxy timeouts and worker priority of ``pagedray serve``'s private Ray
  (``ray_env.LOCAL_RAY_ENV``'s first three; not its throughput mode, which moves the HTTP port).
- Every external call goes through ``run`` (a ``subprocess.run`` stand-in in tests).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from .ray_env import LOCAL_RAY_ENV

CLUSTER_RAY_ENV = {name: LOCAL_RAY_ENV[name] for name in ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S",
                                                          "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S",
                                                          "RAY_worker_niceness")}
STATUS_EVERY_S = 10.0


class DeployError(RuntimeError):
    """A step of the deployment failed; the message says which and what it printed."""


def answers_health(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether ``GET /health`` on the served port answers 200 (a wildcard host is asked on loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    url = f"http://[{host}]:{port}/health" if ":" in host else f"http://{host}:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def http_endpoint(config_path: Path) -> tuple[str, int]:
    """(host, port) of the YAML's ``http_options`` (Serve's defaults: 127.0.0.1, 8000); ValueError naming the
    file when it is not a Serve config."""
    import yaml

    try:
        data = yaml.safe_load(config_path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"config: cannot read {config_path}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("applications"), list):
        raise ValueError(f"config: {config_path} is not a Serve config file (no 'applications' list)")
    http = data.get("http_options") or {}
    return str(http.get("host", "127.0.0.1")), int(http.get("port", 8000))


def cli_env(environ: dict[str, str]) -> dict[str, str]:
    """The environment of every Ray CLI call: token auth unless a mode is set, and the cluster's settings
    (values already in ``environ`` win)."""
    return {**CLUSTER_RAY_ENV, "RAY_AUTH_MODE": "token", **environ}


def _call(run, argv: list[str], env: dict[str, str], what: str) -> subprocess.CompletedProcess:
    done = run(argv, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        output = (done.stdout + done.stderr).strip()[-2000:]
        raise DeployError(f"{what} failed (exit status {done.returncode}):\n{output}")
    return done


def deploy(config_path: Path, address: str | None, timeout_s: float, environ: dict[str, str],
           run: Callable = subprocess.run, healthy: Callable[[str, int], bool] | None = None,
           sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
           say: Callable[[str], None] = print) -> str:
    """Starts Ray (unless ``address``), deploys ``config_path`` and waits for ``/health``; the URL served.
    DeployError when a step fails or the app is not healthy within ``timeout_s``."""
    healthy = answers_health if healthy is None else healthy
    host, port = http_endpoint(config_path)
    env = cli_env(environ)
    ray, serve = [sys.executable, "-m", "ray.scripts.scripts"], [sys.executable, "-m", "ray.serve.scripts"]
    if env["RAY_AUTH_MODE"] == "token":
        _call(run, [*ray, "get-auth-token", "--generate"], env, "ray get-auth-token --generate")
    deploy_argv = [*serve, "deploy", str(config_path)]
    if address:
        deploy_argv += ["--address", _dashboard_address(address)]
    else:
        say("starting Ray: ray start --head")
        _call(run, [*ray, "start", "--head"], env, "ray start --head")
    say(f"deploying {config_path}: serve deploy")
    _call(run, deploy_argv, env, "serve deploy")
    deadline, next_status = clock() + timeout_s, clock() + STATUS_EVERY_S
    while not healthy(host, port):
        if clock() >= deadline:
            raise DeployError(f"the app did not answer http://{host}:{port}/health within {timeout_s:g} s; "
                              f"serve status:\n{shortened(_status(run, serve, env, address))}")
        if clock() >= next_status:
            next_status = clock() + STATUS_EVERY_S
            report = _status(run, serve, env, address)
            if "DEPLOY_FAILED" in report:           # the whole report: a replica's traceback can run for pages
                raise DeployError(f"a deployment failed to start; serve status:\n{shortened(report)}")
        sleep(1.0)
    return f"http://{host}:{port}"


def _dashboard_address(address: str) -> str:
    """``serve deploy``'s ``--address`` is the dashboard's URL; ``auto`` (ray start's cluster) is its default."""
    return "http://127.0.0.1:8265" if address == "auto" else address


def _status(run, serve: list[str], env: dict[str, str], address: str | None) -> str:
    argv = [*serve, "status"] + (["--address", _dashboard_address(address)] if address else [])
    done = run(argv, env=env, capture_output=True, text=True)
    return (done.stdout + done.stderr).strip()


def shortened(report: str, head: int = 2500, tail: int = 2500) -> str:
    """``report`` with its middle left out when longer than ``head + tail`` characters: the head holds the
    applications' and deployments' statuses and messages, the tail the end of a replica's traceback."""
    if len(report) <= head + tail:
        return report
    return f"{report[:head]}\n... ({len(report) - head - tail} characters left out) ...\n{report[-tail:]}"


def run_deploy(config: str, address: str | None, timeout_s: float) -> int:
    """The ``pagedray deploy`` command: 0 once the app answers, 2 for a config file that cannot be read as a
    Serve config (before anything starts), 1 (the failing step's report) otherwise."""
    try:
        http_endpoint(Path(config))
    except ValueError as exc:
        print(f"pagedray deploy: error: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        url = deploy(Path(config), address, timeout_s, dict(os.environ))
    except DeployError as exc:
        print(f"pagedray deploy: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"pagedray is serving at {url}/v1 (serve shutdown -y && ray stop ends it)", flush=True)
    return 0
