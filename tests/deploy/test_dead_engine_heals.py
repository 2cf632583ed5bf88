"""A dead engine heals (issue #32): when the engine dies of a failure no request owns (here: its TP
worker is killed with rank recovery off, ``max_rank_restarts=0``) while its replica process lives on,
/health says "engine dead" without internals, the replica's ``check_health`` fails, and Serve replaces
the replica: a new one answers. The default one-replica layout (the engine inside the ingress replica),
as ``pagedray serve`` runs it.

Before #32 nothing bounded this in time and the ingress deployment kept Serve's default health-check
period; the waits below are hang guards only, never timing assertions.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from helpers.serve_fixtures import API_KEY, start_app, stop_app, tp_worker_pids
from pagedray.deploy.openai.sse import parse_sse

# slow: the extended tier (README: -m slow); CI keeps test_serve_app.py's dead engine replica replaced mid-stream
pytestmark = [pytest.mark.integration, pytest.mark.slow]   # starts Ray, Serve or a process

AUTH = {"Authorization": f"Bearer {API_KEY}"}
HANG_GUARD_S = 300


@pytest.fixture(scope="module")
def app(ray_session, default_model_path):
    running = start_app(default_model_path, executor="ray", engine_in_ingress=True, max_rank_restarts=0)
    yield running
    stop_app(running)


def _wait_for(predicate, what: str):
    deadline = time.monotonic() + HANG_GUARD_S
    while not predicate():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.5)


def test_a_dead_engine_is_replaced_and_the_new_replica_answers(app):
    http = httpx.Client(base_url=app.url, headers=AUTH, timeout=120, trust_env=False)
    first = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert first.status_code == 200, first.text
    workers = tp_worker_pids()
    assert len(workers) == 1
    body = {"prompt": "Count to one hundred:", "max_tokens": 200, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
        os.kill(workers[0], signal.SIGKILL)   # the step fails; recovery is off: the engine is dead
        events = parse_sse("\n\n".join(line for line in lines if line.startswith("data: ")))
    errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    assert errors and errors[0]["message"].startswith("engine dead") and "Traceback" not in str(errors)

    health = http.get("/health")
    if health.status_code == 503:   # Serve may already have replaced the replica
        assert health.json()["reason"].startswith("engine dead") and "File " not in health.text

    _wait_for(lambda: http.get("/health").status_code == 200 and len(tp_worker_pids()) == 1
              and tp_worker_pids() != workers, "a new replica")
    again = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
