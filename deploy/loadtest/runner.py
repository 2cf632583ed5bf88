"""Issuing the load: open-loop Poisson arrivals or a closed loop at fixed concurrency.

Decisions: docs/design/deploy.md, ``pagedray.deploy.loadtest.runner``.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from pagedray.deploy.loadtest.metrics import MetricsSeries, poll_metrics
from pagedray.deploy.loadtest.prompts import PromptSpec
from pagedray.deploy.loadtest.record import RequestRecord
from tqdm import tqdm


@dataclass(frozen=True)
class LoadSpec:
    """How much load, and for how long. Exactly one of ``rate`` / ``concurrency`` is set."""

    num_requests: int
    rate: float | None = None
    concurrency: int | None = None
    duration_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.num_requests, int) or self.num_requests < 1:
            raise ValueError(f"num_requests: must be a positive integer, got {self.num_requests!r}")
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError("rate/concurrency: give exactly one of them (open loop or closed loop)")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate: must be > 0 requests/s (inf sends all at once), got {self.rate!r}")
        if self.concurrency is not None and (not isinstance(self.concurrency, int) or self.concurrency < 1):
            raise ValueError(f"concurrency: must be a positive integer, got {self.concurrency!r}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration: must be > 0 seconds, got {self.duration_s!r}")

    @property
    def label(self) -> str:
        return f"rate={self.rate:g}/s" if self.rate is not None else f"concurrency={self.concurrency}"


@dataclass
class RunResult:
    load: LoadSpec
    records: list[RequestRecord]   # in issue order
    duration_s: float
    metrics: MetricsSeries = field(default_factory=MetricsSeries)


def poisson_arrivals(rate: float, num_requests: int, seed: int) -> list[float]:
    """Arrival times (seconds from the start) of ``num_requests`` Poisson arrivals at ``rate``/s."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num_requests):
        times.append(now)
        now += rng.expovariate(rate)
    return times


class _Issuer:
    """Sends request i through the target and keeps its record."""

    def __init__(self, target, prompts: list[PromptSpec], start: float, progress: tqdm,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.target, self.prompts, self.start, self.progress = target, prompts, start, progress
        self.clock = clock
        self.records: dict[int, RequestRecord] = {}

    def elapsed(self) -> float:
        return self.clock() - self.start

    async def issue(self, index: int) -> None:
        prompt_index = index % len(self.prompts)
        record = RequestRecord(index=index, prompt_index=prompt_index, send_s=self.elapsed())
        self.records[index] = record
        await self.target.send(self.prompts[prompt_index], record)
        self.progress.update(1)


async def _open_loop(issuer: _Issuer, load: LoadSpec, sleep: Callable[[float], Awaitable[None]]) -> None:
    tasks = []
    for index, arrival in enumerate(poisson_arrivals(load.rate, load.num_requests, load.seed)):
        if load.duration_s is not None and arrival >= load.duration_s:
            break
        delay = arrival - issuer.elapsed()
        if delay > 0:
            await sleep(delay)
        tasks.append(asyncio.create_task(issuer.issue(index)))
    await asyncio.gather(*tasks)


async def _closed_loop(issuer: _Issuer, load: LoadSpec) -> None:
    next_index = iter(range(load.num_requests))

    async def worker() -> None:
        for index in next_index:  # shared iterator: each index is taken by exactly one worker
            await issuer.issue(index)
            if load.duration_s is not None and issuer.elapsed() >= load.duration_s:
                return

    await asyncio.gather(*(worker() for _ in range(load.concurrency)))


async def run_load(target, prompts: list[PromptSpec], load: LoadSpec, metrics_url: str | None = None,
                   metrics_interval_s: float = 1.0, progress: bool = True,
                   clock: Callable[[], float] = time.perf_counter,
                   sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> RunResult:
    """Run one load against an entered target; returns every record, failed ones included. ``clock`` and
    ``sleep`` pace the open loop's sends and time them (tests pass a virtual clock)."""
    if not prompts:
        raise ValueError("prompts: need at least one prompt")
    series = MetricsSeries()
    stop = asyncio.Event()
    start = clock()
    poller = None
    if metrics_url:
        poller = asyncio.create_task(poll_metrics(metrics_url, metrics_interval_s, time.perf_counter(), series,
                                                  stop))
    bar = tqdm(total=load.num_requests, desc=load.label, unit="req", disable=not progress, leave=False)
    issuer = _Issuer(target, prompts, start, bar, clock)
    try:
        if load.rate is not None:
            await _open_loop(issuer, load, sleep)
        else:
            await _closed_loop(issuer, load)
    finally:
        duration = issuer.elapsed()
        bar.close()
        stop.set()
        if poller is not None:
            await poller
    records = [issuer.records[index] for index in sorted(issuer.records)]
    return RunResult(load=load, records=records, duration_s=duration, metrics=series)
