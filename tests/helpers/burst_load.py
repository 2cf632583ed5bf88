"""Overload measurement: a burst of concurrent requests against a running app, and what came back.

Used by tests/deploy/test_abuse_serve.py and benchmarks/reliability.py. The burst sends ``count`` copies of
one completion body at once (asyncio + httpx, one connection each) and records, per request, the
status, the latency to the response (for a 429/503: the time to the rejection) and the text. A
``StatsSampler`` thread polls the engine's stats during the burst, so the queue bound can be checked
against what the engine really held (not only against what the clients saw).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True)
class BurstReply:
    status: int
    latency_s: float
    text: str | None            # choices[0].text of a 200
    error_code: str | None      # error.code of a 4xx / 5xx
    retry_after: str | None     # the Retry-After header


@dataclass
class BurstResult:
    replies: list[BurstReply]
    wall_s: float

    def with_status(self, *statuses: int) -> list[BurstReply]:
        return [r for r in self.replies if r.status in statuses]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


async def _one(client: httpx.AsyncClient, body: dict) -> BurstReply:
    start = time.monotonic()
    response = await client.post("/v1/completions", json=body)
    latency = time.monotonic() - start
    payload = response.json()
    if response.status_code == 200:
        return BurstReply(200, latency, payload["choices"][0]["text"], None, None)
    return BurstReply(response.status_code, latency, None, payload.get("error", {}).get("code"),
                      response.headers.get("retry-after"))


async def burst(url: str, headers: dict, body: dict, count: int, timeout_s: float = 300.0) -> BurstResult:
    """Send ``count`` copies of ``body`` to /v1/completions at once (non-streaming)."""
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout_s, limits=limits,
                                 trust_env=False) as client:
        start = time.monotonic()
        replies = await asyncio.gather(*(_one(client, body) for _ in range(count)))
        return BurstResult(list(replies), time.monotonic() - start)


@dataclass
class StatsSampler:
    """Polls ``get_stats()`` (EngineStats) every ``period_s`` in a thread until stopped."""

    get_stats: Callable[[], object]
    period_s: float = 0.05
    samples: list = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> StatsSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.get_stats())
            self._stop.wait(self.period_s)

    def max_of(self, attr: str):
        return max(getattr(s, attr) for s in self.samples)


def rss_bytes(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss
