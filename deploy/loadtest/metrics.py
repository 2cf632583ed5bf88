"""Polling the target's Prometheus ``/metrics`` endpoint while a load runs.

Expected metric names (gauges, one sample per engine replica; ``deploy/openai/metrics.py`` exports them):
- ``pagedray:num_requests_running``: requests being decoded / prefilled now (queue: running)
- ``pagedray:num_requests_waiting``: requests admitted but waiting for KV blocks or a batch slot
- ``pagedray:kv_cache_usage_perc``: used KV blocks / all KV blocks, 0..1
A sample with labels (one per replica or per model) is summed over its label sets for the two counts and
averaged for the usage ratio. Names are matched exactly; Prometheus client suffixes are not guessed.

Decisions: docs/design/deploy.md, ``pagedray.deploy.loadtest.metrics``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx

RUNNING = "pagedray:num_requests_running"
WAITING = "pagedray:num_requests_waiting"
KV_USAGE = "pagedray:kv_cache_usage_perc"
WATCHED = (RUNNING, WAITING, KV_USAGE)


def parse_prometheus(text: str, names: tuple[str, ...] = WATCHED) -> dict[str, float]:
    """Sum (counts) or average (usage ratio) the samples of each watched metric found in ``text``."""
    values: dict[str, list[float]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name_part, _, rest = line.partition(" ")
        name = name_part.split("{", 1)[0]
        if "{" in name_part and "}" not in name_part:  # labels with spaces: value follows the brace
            labels_end = line.index("}")
            rest = line[labels_end + 1:]
        if name not in names:
            continue
        fields = rest.split()
        if not fields:
            continue
        try:
            values.setdefault(name, []).append(float(fields[0]))
        except ValueError:
            continue
    out = {}
    for name, samples in values.items():
        out[name] = sum(samples) / len(samples) if name == KV_USAGE else sum(samples)
    return out


@dataclass
class MetricsSeries:
    """Time series polled during a run; ``times`` are seconds since the run started."""

    times: list[float] = field(default_factory=list)
    values: dict[str, list[float | None]] = field(default_factory=lambda: {name: [] for name in WATCHED})
    note: str = ""

    def add(self, at: float, sample: dict[str, float]) -> None:
        self.times.append(at)
        for name in WATCHED:
            self.values[name].append(sample.get(name))

    def to_json(self) -> dict:
        return {"times_s": self.times, "values": self.values, "note": self.note}


async def poll_metrics(url: str, interval_s: float, run_start: float, series: MetricsSeries,
                       stop: asyncio.Event) -> None:
    """Poll ``url`` every ``interval_s`` until ``stop`` is set; failures only leave a note."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(max(interval_s, 1.0)), trust_env=False) as client:
        while not stop.is_set():
            try:
                response = await client.get(url)
                if response.status_code == 404:
                    series.note = f"{url} answered HTTP 404: not polled again"
                    return
                if response.status_code != 200:
                    series.note = f"{url} answered HTTP {response.status_code}"
                else:
                    sample = parse_prometheus(response.text)
                    if sample:
                        series.add(time.perf_counter() - run_start, sample)
                    else:
                        series.note = f"{url} exports none of {', '.join(WATCHED)}"
            except httpx.HTTPError as err:
                series.note = f"{url} unreachable: {type(err).__name__}"
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except asyncio.TimeoutError:
                pass
