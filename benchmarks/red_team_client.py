"""The red-team benchmarks' HTTP helpers (red_team.py and red_team_isolation.py both use them): the API key
the servers start with, a JSON POST, a function run over argument tuples in threads, and a stream's
longest gap between chunks."""

from __future__ import annotations

import json
import threading
import time

import httpx

API_KEY = "red-team-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def post(url: str, body, timeout: float = 600.0, raw: bytes | None = None, path: str = "/v1/completions"):
    headers = {**AUTH, "Content-Type": "application/json"}
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers=headers, timeout=timeout, trust_env=False)


def in_threads(fn, args_list: list) -> list:
    results = [None] * len(args_list)

    def run(i, args):
        try:
            results[i] = fn(*args)
        except Exception as exc:  # noqa: BLE001 - reported as the case's outcome
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def stream_gaps(url: str, body: dict, out: dict) -> None:
    """Stream a completion and record the longest gap between chunks."""
    last, gap = None, 0.0
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=600, trust_env=False) as response:
        for _ in response.iter_lines():
            now = time.monotonic()
            if last is not None:
                gap = max(gap, now - last)
            last = now
    out["max_gap_s"] = gap
