"""The ``engine_in_ingress`` layout: the engine runs inside the ingress replica (Ray TP worker, fp32).

The behaviour tests of ``test_serve_app`` run again here, against this layout (each test below calls
its namesake there with this module's ``app``): greedy text equal to the offline engine,
streams, n > 1, the handle API, a disconnect freeing blocks, 429 on overload, /metrics, and a TP rank
killed mid-stream recovered with the exact tokens. Then what only this layout has: no engine deployment,
and drain / shutdown handled by the ingress replica itself (last: it leaves the replica draining).
"""

from __future__ import annotations

import threading
import time

import httpx
import psutil
import pytest
import test_serve_app as split_layout
from helpers.bad_requests import assert_openai_error
from helpers.serve_fixtures import start_app, stop_app, stream_in_thread, stream_text, tp_worker_pids
from test_serve_app import client, http, offline_greedy  # noqa: F401 - the shared tests' fixtures

pytestmark = pytest.mark.integration   # starts Ray, Serve or a process (tests/conftest.py)

DRAIN_HANG_GUARD_S = 600.0   # far longer than the in-flight request needs, even on a loaded machine


@pytest.fixture(scope="module")
def app(ray_session, default_model_path):
    running = start_app(default_model_path, executor="ray", engine_in_ingress=True)
    yield running
    stop_app(running)


# test_serve_app's tests against this layout, in that module's order (test_metrics_text counts the 429s
# of the overload test; the rank death runs last of them)
def test_completions_greedy_equal_offline_llm(client, app, offline_greedy):  # noqa: F811
    split_layout.test_completions_greedy_equal_offline_llm(client, app, offline_greedy)


def test_completion_stream_equals_whole(client, app, offline_greedy):  # noqa: F811
    split_layout.test_completion_stream_equals_whole(client, app, offline_greedy)


def test_n_samples(client, app):  # noqa: F811
    split_layout.test_n_samples(client, app)


def test_handle_plain_and_streaming(app, http, offline_greedy):  # noqa: F811
    split_layout.test_handle_plain_and_streaming(app, http, offline_greedy)


def test_disconnect_mid_stream_frees_blocks(app, http):  # noqa: F811
    split_layout.test_disconnect_mid_stream_frees_blocks(app, http)


def test_overload_is_rejected_with_429(app):
    split_layout.test_overload_is_rejected_with_429(app)


def test_metrics_text(app, http):  # noqa: F811
    split_layout.test_metrics_text(app, http)


def test_dead_tp_rank_mid_stream_is_recovered_with_exact_tokens(app, http):  # noqa: F811
    split_layout.test_dead_tp_rank_mid_stream_is_recovered_with_exact_tokens(app, http)


def test_the_app_has_no_engine_deployment(app):
    from pagedray.deploy.serve.ingress import INGRESS_DEPLOYMENT_NAME
    from ray import serve

    deployments = serve.status().applications[app.name].deployments
    assert set(deployments) == {INGRESS_DEPLOYMENT_NAME}
    assert len(tp_worker_pids()) == 1   # the engine in the ingress drives one TP worker actor


def test_drain_by_the_ingress_then_delete_stops_the_worker(app, http):  # noqa: F811
    from ray import serve

    body = {"prompt": "Count:", "max_tokens": 96, "temperature": 0, "ignore_eos": True}
    reference = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    started, out = threading.Event(), {}
    thread = stream_in_thread(app.url, body, started, out)
    assert started.wait(120)
    report = serve.get_app_handle(app.name).drain.remote(DRAIN_HANG_GUARD_S)
    # wait for the drain through /health, which is no request to the engine: a completion sent as a probe
    # could itself be in flight when the drain starts and be counted in the report
    deadline = time.monotonic() + 120   # hang guard: until the drain has reached the engine
    while (health := httpx.get(f"{app.url}/health", timeout=30, trust_env=False)).status_code == 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert health.status_code == 503 and "draining" in health.json()["reason"]
    refused = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert assert_openai_error(refused, 503, None)["code"] == "engine_draining"
    report = report.result()
    thread.join(120)
    assert out["status"] == 200 and stream_text(out["events"])[:2] == (reference, "length")
    assert report.in_flight_at_start == 1 and report.aborted == 0
    idle = app.wait_idle()
    assert (idle.num_running, idle.num_waiting, idle.num_free_blocks) == (0, 0, idle.num_blocks)
    workers = tp_worker_pids()
    assert len(workers) == 1
    serve.delete(app.name)   # the ingress' __del__ shuts the engine down, and with it the TP worker
    deadline = time.monotonic() + 120   # hang guard
    while psutil.pid_exists(workers[0]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not psutil.pid_exists(workers[0])
