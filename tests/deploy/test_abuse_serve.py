"""Abuse resistance of the real Serve app (ingress + engine deployment running the model in its own
process, ``executor: local``; SmolLM2, fp32).

One app for the module (capacity: max_num_seqs 4 running + max_queued_requests 4 waiting):
- the malformed-input catalogue (tests/helpers/bad_requests.py, > 100 cases): each a 4xx with an
  OpenAI error body, and the engine's stats (blocks, queues, every counter) identical afterwards;
- a hypothesis fuzz of both POST routes (1,000 derandomized examples sent 4 at a time,
  tests/helpers/fuzz_requests.py):
  no 5xx, no in-band internal error, and every KV block free afterwards;
- overload at 10x capacity: only 200 / 429; every 200 is the greedy reference text; 429s carry
  Retry-After; the engine's waiting queue never exceeds its bound; replica memory stays bounded;
- graceful drain (last: it leaves the replica draining): the in-flight requests finish with their exact
  text (the drain's timeout is only a hang guard, so the outcome does not depend on the machine's
  speed; the abort at a timeout is tested on a fake clock in tests/cluster/test_async_engine.py), new
  ones get 503, /health says 503; deleting the app ends the engine replica's process.
Oracle for greedy text: the same prompt run alone on the idle app before the burst / the drain.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time

import httpx
import psutil
import pytest
from helpers.bad_requests import assert_openai_error, malformed_cases, send
from helpers.burst_load import StatsSampler, burst, percentile, rss_bytes
from helpers.fuzz_requests import run_fuzz
from helpers.serve_fixtures import API_KEY, APP_ARGS, start_app, stop_app, stream_in_thread, stream_text, tp_worker_pids

pytestmark = pytest.mark.integration   # starts Ray, Serve or a process (tests/conftest.py)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
FUZZ_EXAMPLES = 500     # ~20 s on 2 cores (the engine-level fuzz in test_engine_fuzz.py runs beside it)
FUZZ_CONCURRENCY = 4
CAPACITY = APP_ARGS["max_num_seqs"] + APP_ARGS["max_queued_requests"]
OVERLOAD_REQUESTS = 10 * CAPACITY
OVERLOAD_BODY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
RSS_GROWTH_LIMIT = 256 * 2**20   # generous: what matters is that it does not scale with the burst
DRAIN_HANG_GUARD_S = 600.0   # far longer than the in-flight requests need, even on a loaded machine


@pytest.fixture(scope="module")
def app(ray_session, default_model_path):
    running = start_app(default_model_path, executor="local")   # the in-process layout (test_serve_app: Ray)
    yield running
    stop_app(running)


@pytest.fixture(scope="module")
def http(app):
    with httpx.Client(base_url=app.url, headers=AUTH, timeout=300, trust_env=False) as client:
        yield client


def test_malformed_catalogue_is_4xx_and_leaves_the_engine_untouched(app, http):
    cases = malformed_cases(app.model, app.max_model_len, app.vocab_size)
    assert len(cases) >= 50
    before = app.wait_idle()
    for name, path, body, status, param in cases:
        response = send(http, path, body)
        assert response.status_code == status, (name, response.status_code, response.text)
        assert_openai_error(response, status, param)
    assert app.engine_stats() == before


def test_hypothesis_fuzz_never_5xx_and_frees_every_block(app, http):
    report = run_fuzz(http, app.model, app.vocab_size, FUZZ_EXAMPLES, FUZZ_CONCURRENCY)
    assert report.failures == []
    assert sum(report.tally.values()) == FUZZ_EXAMPLES
    # the mix exercised both the engine and the validators
    assert report.tally["ok"] >= FUZZ_EXAMPLES // 20 and report.tally["client_error"] >= FUZZ_EXAMPLES // 4, report
    idle = app.wait_idle()
    assert (idle.num_running, idle.num_waiting, idle.num_free_blocks) == (0, 0, idle.num_blocks)


def test_overload_10x_rejects_excess_and_admitted_requests_are_exact(app, http):
    reference = http.post("/v1/completions", json=OVERLOAD_BODY).json()["choices"][0]["text"]
    pid = app.engine_handle().process_id.remote().result()
    asyncio.run(burst(app.url, AUTH, OVERLOAD_BODY, CAPACITY))   # warm-up at capacity
    app.wait_idle()
    rss_before = rss_bytes(pid)
    with StatsSampler(app.engine_stats) as sampler:
        result = asyncio.run(burst(app.url, AUTH, OVERLOAD_BODY, OVERLOAD_REQUESTS))
    rss_after = rss_bytes(pid)
    admitted, rejected = result.with_status(200), result.with_status(429)
    assert len(admitted) + len(rejected) == OVERLOAD_REQUESTS, collections.Counter(r.status for r in result.replies)
    assert len(admitted) >= APP_ARGS["max_queued_requests"] and rejected
    assert all(r.text == reference for r in admitted)
    assert all(r.error_code == "queue_full" and r.retry_after == "1" for r in rejected)
    assert sampler.max_of("num_waiting") <= APP_ARGS["max_queued_requests"]
    assert sampler.max_of("num_running") <= APP_ARGS["max_num_seqs"]
    # rejections are answered without waiting for a slot: faster than the admitted requests
    assert percentile([r.latency_s for r in rejected], 50) < percentile([r.latency_s for r in admitted], 50)
    assert rss_after - rss_before < RSS_GROWTH_LIMIT, (rss_before, rss_after)
    idle = app.wait_idle()
    assert (idle.num_running, idle.num_waiting, idle.num_free_blocks) == (0, 0, idle.num_blocks)


def _await_draining(http) -> httpx.Response:
    """POST until the drain has reached the engine (a request racing the drain call may still run)."""
    deadline = time.monotonic() + 120   # hang guard
    while True:
        response = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        if response.status_code != 200 or time.monotonic() > deadline:
            return response
        time.sleep(0.05)


def test_drain_finishes_in_flight_rejects_new_then_delete_leaves_nothing(app, http):
    from ray import serve

    short = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    longer = {"prompt": "Count:", "max_tokens": 128, "temperature": 0, "ignore_eos": True}
    bodies = {"longer": longer, "short": short}   # started in this order
    references = {name: http.post("/v1/completions", json=body).json()["choices"][0]["text"]
                  for name, body in bodies.items()}
    started = {name: threading.Event() for name in bodies}
    outs: dict[str, dict] = {name: {} for name in bodies}
    threads = [stream_in_thread(app.url, body, started[name], outs[name]) for name, body in bodies.items()]
    assert all(event.wait(120) for event in started.values())
    report = serve.get_app_handle(app.name).drain.remote(DRAIN_HANG_GUARD_S)
    refused = _await_draining(http)
    assert assert_openai_error(refused, 503, None)["code"] == "engine_draining"
    health = http.get("/health")
    assert health.status_code == 503 and "draining" in health.json()["reason"]
    report = report.result()
    for thread in threads:
        thread.join(120)
    for name, out in outs.items():
        assert out["status"] == 200 and stream_text(out["events"])[:2] == (references[name], "length"), name
    assert report.in_flight_at_start >= 1 and report.aborted == 0
    # draining is one-way: still refused after the in-flight requests are done
    assert http.post("/v1/completions", json=short).status_code == 503
    idle = app.wait_idle()
    assert (idle.num_running, idle.num_waiting, idle.num_free_blocks) == (0, 0, idle.num_blocks)
    replica_pid = app.engine_handle().process_id.remote().result()
    assert psutil.pid_exists(replica_pid) and tp_worker_pids() == []   # in-process: no worker actor
    serve.delete(app.name)
    deadline = time.monotonic() + 120   # hang guard
    while psutil.pid_exists(replica_pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not psutil.pid_exists(replica_pid)
