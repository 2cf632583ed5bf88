"""Slow: ``serve deploy`` of deploy/serve/serve.yaml with an ``autoscaling_config`` (and the KV-pressure policy)
scales the engine from 1 to 2 replicas under a load test and back to 1 when it stops.

A private Ray head as in test_serve_yaml.py (4 CPUs: two replicas of 2 bundles each). Serve's own signal
decides here: 6 clients sending requests back to back against ``target_ongoing_requests`` 2 want 3
replicas (capped at 2); idle, the policy wants 1. The delays are short so that the test is quick; every
wait is a hang guard, so the outcome never depends on how fast the machine is.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import yaml
from pagedray.deploy.routing.autoscaling import KV_PRESSURE_POLICY
from test_serve_yaml import DEPLOY_TIMEOUT_S, cli, ray_head, run, write_config  # noqa: F401 - ray_head: fixture

pytestmark = pytest.mark.integration   # starts Ray, Serve or a process (tests/conftest.py)

SCALING = {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 1, "target_ongoing_requests": 2,
           "upscale_delay_s": 1, "downscale_delay_s": 5, "metrics_interval_s": 0.5, "look_back_period_s": 2,
           "policy": {"policy_function": KV_PRESSURE_POLICY}}
HANG_GUARD_S = 600.0


def running_engine_replicas(head) -> int:
    status = run([cli("serve"), "status", "-a", head.dashboard_url], timeout=60)
    if status.returncode != 0:
        return -1
    apps = (yaml.safe_load(status.stdout) or {}).get("applications") or {}
    engine = ((apps.get("pagedray") or {}).get("deployments") or {}).get("PagedEngine") or {}
    return int((engine.get("replica_states") or {}).get("RUNNING", 0))


def wait_for_replicas(head, count: int) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while (seen := running_engine_replicas(head)) != count:
        assert time.monotonic() < deadline, f"still {seen} running engine replicas, waiting for {count}"
        time.sleep(2.0)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_serve_deploy_with_autoscaling_goes_from_one_to_two_replicas_and_back(ray_head):  # noqa: F811
    path = write_config(ray_head)
    config = yaml.safe_load(path.read_text())
    args = config["applications"][0]["args"]
    del args["num_replicas"]
    args.update({"autoscaling_config": SCALING, "threads_per_worker": 1, "max_num_seqs": 4})
    path.write_text(yaml.safe_dump(config))
    deployed = run([cli("serve"), "deploy", str(path), "-a", ray_head.dashboard_url], timeout=120)
    assert deployed.returncode == 0, deployed.stderr + deployed.stdout
    url = f"http://127.0.0.1:{ray_head.http}"
    ray_head._wait_for(lambda: httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200,
                       DEPLOY_TIMEOUT_S, "the Serve app")
    assert running_engine_replicas(ray_head) == 1

    stop = threading.Event()
    statuses: list[int] = []

    def load() -> None:
        body = {"prompt": "Count to a thousand:", "max_tokens": 64, "ignore_eos": True}
        with httpx.Client(base_url=url, timeout=HANG_GUARD_S, trust_env=False) as client:
            while not stop.is_set():
                statuses.append(client.post("/v1/completions", json=body).status_code)

    clients = [threading.Thread(target=load, daemon=True) for _ in range(6)]
    for thread in clients:
        thread.start()
    try:
        wait_for_replicas(ray_head, 2)
    finally:
        stop.set()
        for thread in clients:
            thread.join(HANG_GUARD_S)
    wait_for_replicas(ray_head, 1)
    assert statuses and set(statuses) <= {200, 429}, sorted(set(statuses))
