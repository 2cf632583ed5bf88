"""Stream failover on a real Serve app with two engine replicas (one node): four streams run (greedy and
seeded; completions and chat), one engine replica's actor is killed while they stream, and every stream
still ends with exactly the text of an undisturbed run: the ingress continued the lost ones on the other
replica (deploy/serve/failover.py). /metrics counts the failovers (``pagedray:request_failovers_total``)."""

from __future__ import annotations

import threading

import httpx
import pytest
from helpers.serve_fixtures import API_KEY, start_app, stop_app
from pagedray.deploy.openai.sse import parse_sse

pytestmark = pytest.mark.integration   # starts Ray, Serve or a process (tests/conftest.py)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
REQUESTS = [
    ("/v1/completions", {"prompt": "Count from one to fifty in words:", "temperature": 0}),
    ("/v1/completions", {"prompt": "Once upon a time", "temperature": 0.9, "seed": 5, "top_p": 0.95}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Describe the sea."}], "temperature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story."}], "temperature": 0.8,
                              "seed": 9}),
]
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def app(ray_session, default_model_path):
    running = start_app(default_model_path, num_replicas=2, executor="local")
    yield running
    stop_app(running)


def _text(path: str, events: list) -> str:
    key = "text" if path == "/v1/completions" else "delta"
    parts = []
    for event in events:
        for choice in event.get("choices", []) if isinstance(event, dict) else []:
            parts.append(choice["text"] if key == "text" else choice["delta"].get("content") or "")
    return "".join(parts)


def _stream(url: str, path: str, body: dict, started: threading.Event, out: dict) -> threading.Thread:
    def run() -> None:
        with httpx.Client(base_url=url, headers=AUTH, timeout=600, trust_env=False) as client:
            with client.stream("POST", path, json={**body, "stream": True}) as response:
                lines = []
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        started.set()
        out["events"] = parse_sse("\n\n".join(lines))
        started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _failovers(http) -> float:
    line = next(line for line in http.get("/metrics").text.splitlines()
                if line.startswith("pagedray:request_failovers_total"))
    return float(line.rsplit(" ", 1)[1])


def test_streams_of_a_killed_replica_finish_exactly_on_the_other(app):
    import ray

    http = httpx.Client(base_url=app.url, headers=AUTH, timeout=600, trust_env=False)
    bodies = [(path, {**body, "max_tokens": MAX_TOKENS, "ignore_eos": True}) for path, body in REQUESTS]
    expected = []
    for path, body in bodies:
        response = http.post(path, json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        expected.append(choice["text"] if path == "/v1/completions" else choice["message"]["content"])
    replicas = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                      if a["namespace"] == "serve" and "PagedEngine" in a["name"])
    assert len(replicas) == 2, replicas
    before = _failovers(http)
    outs = [{} for _ in bodies]
    started = [threading.Event() for _ in bodies]
    threads = [_stream(app.url, path, body, started[i], outs[i]) for i, (path, body) in enumerate(bodies)]
    for event in started:
        assert event.wait(300), "a stream did not start"
    ray.kill(ray.get_actor(replicas[0], namespace="serve"), no_restart=True)
    for thread in threads:
        thread.join(600)
    for (path, _), out, text in zip(bodies, outs, expected):
        events = out["events"]
        assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events), events[-3:]
        assert _text(path, events) == text
    assert _failovers(http) > before
