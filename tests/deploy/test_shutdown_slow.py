"""``serve delete`` with a request in flight (slow: deploys its own app, ~1 minute on 2 cores).

Serve stops routing to the replicas at once (the proxy answers new requests with its own 404), waits
for the calls in flight (the stream must finish with exactly the text the same prompt gives alone),
then runs the engine deployment's ``__del__`` (abort leftovers, stop the TP workers): no TP worker
process may remain. The fast CI counterpart (drain method: 503s, a clean cut at the timeout, delete
leaves no worker) is ``test_abuse_serve.py::test_drain_finishes_in_flight_rejects_new_then_delete_leaves_nothing``.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from helpers.serve_fixtures import API_KEY, start_app, stop_app, stream_in_thread, stream_text, tp_worker_pids

pytestmark = pytest.mark.integration   # starts Ray, Serve or a process (tests/conftest.py)

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.mark.slow
def test_serve_delete_lets_in_flight_stream_finish(ray_session, default_model_path):
    from ray import serve

    app = start_app(default_model_path, graceful_shutdown_s=60.0, executor="ray")
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        with httpx.Client(base_url=app.url, headers=AUTH, timeout=300, trust_env=False) as http:
            reference = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
            started, out = threading.Event(), {}
            thread = stream_in_thread(app.url, body, started, out)
            assert started.wait(120)
            serve.delete(app.name, _blocking=False)
            statuses = set()
            while thread.is_alive():
                statuses.add(http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code)
                time.sleep(0.2)
        thread.join()
        assert out["status"] == 200 and stream_text(out["events"])[:2] == (reference, "length")
        assert statuses <= {200, 404, 503}, statuses   # served before the route went, then refused
        deadline = time.monotonic() + 60
        while tp_worker_pids() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert tp_worker_pids() == []
    finally:
        stop_app(app)
