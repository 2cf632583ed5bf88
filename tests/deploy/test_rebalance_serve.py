"""Rebalancing on a real Serve app (#65, deploy/serve/rebalance.py): two engine replicas, four streams of one prompt
that the cache-aware router all sends to the replica holding its prefix (``router_max_imbalance`` 16); that
replica hands half of them over, with their KV blocks through the object store, to the idle one
(``rebalance_threshold`` 1), and every stream still ends with exactly the text of an undisturbed run. /metrics
counts the moves (``pagedray:request_moves_total``), not as failovers."""

from __future__ import annotations

import threading

import httpx
import pytest
from helpers.serve_fixtures import API_KEY, counter_total, failovers_total, start_app, stop_app, stream_in_thread

# slow: the extended tier (README: -m slow); CI keeps test_rebalance.py (rebalancing is off by default)
pytestmark = [pytest.mark.integration, pytest.mark.slow]   # starts Ray, Serve or a process

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "Here is a long list of the animals of the forest, one per line, with a short note on each:"
SAMPLINGS = [{"temperature": 0}, {"temperature": 0.9, "seed": 5}, {"temperature": 0.7, "seed": 8, "top_p": 0.9},
             {"temperature": 0.8, "seed": 13}]
MAX_TOKENS = 300   # streams long enough for a rebalancing round (every 2 s) to find them running


@pytest.fixture(scope="module")
def app(ray_session, default_model_path):
    running = start_app(default_model_path, num_replicas=2, executor="local", rebalance_threshold=1,
                        router_max_imbalance=16)
    yield running
    stop_app(running)


def _text(events: list) -> str:
    return "".join(choice["text"] for event in events if isinstance(event, dict)
                   for choice in event.get("choices", []))


def test_a_busy_replica_moves_streams_to_an_idle_one_and_they_go_on_exactly(app):
    http = httpx.Client(base_url=app.url, headers=AUTH, timeout=600, trust_env=False)
    bodies = [{"prompt": PROMPT, **sampling, "max_tokens": MAX_TOKENS, "ignore_eos": True} for sampling in SAMPLINGS]
    expected = []
    for body in bodies:   # one at a time: undisturbed, and the prompt's prefix cached on one replica
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        expected.append(response.json()["choices"][0]["text"])
    moves_before, failovers_before = counter_total(http, "pagedray:request_moves_total"), failovers_total(http)
    outs = [{} for _ in bodies]
    started = [threading.Event() for _ in bodies]
    threads = [stream_in_thread(app.url, body, started[i], outs[i]) for i, body in enumerate(bodies)]
    for thread in threads:
        thread.join(600)
    for out, text in zip(outs, expected):
        events = out["events"]
        assert out["status"] == 200 and events[-1] == "[DONE]", events[-3:]
        assert not any(isinstance(e, dict) and "error" in e for e in events), events[-3:]
        assert _text(events) == text
    assert counter_total(http, "pagedray:request_moves_total") >= moves_before + 1
    assert failovers_total(http) == failovers_before
