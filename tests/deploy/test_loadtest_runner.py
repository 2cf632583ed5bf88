"""Load tester against the fake OpenAI server: load shapes, stopping, measured latencies, failure causes.

Latency oracles come from the fake's fixed delays, as lower bounds only (the server sleeps at least that
long before writing, and the client sends before the server receives): how late a loaded machine reads
an event is not bounded, so no test asserts an upper bound on a wall-clock time. Open-loop schedules run
on a virtual clock (``VirtualTime``: the runner's sleeps advance it), so send times are exact.
"""

import asyncio
import math

import pytest
from helpers.fake_openai_server import FakeBehavior, FakeOpenAIServer
from pagedray.deploy.loadtest.client import HttpTarget, RequestOptions
from pagedray.deploy.loadtest.prompts import LengthRange, synthetic_prompts
from pagedray.deploy.loadtest.runner import LoadSpec, poisson_arrivals, run_load
from pagedray.deploy.loadtest.stats import latency_samples, percentile, summarize

EPS = 0.002  # timer granularity


class VirtualTime:
    """A clock that moves only when the runner sleeps (by exactly the time asked)."""

    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0)   # the sends already due start first (they read the clock at once)
        self.now += seconds


def run(url: str, load: LoadSpec, num_prompts: int, tokens: int, timeout_s: float = 10.0,
        metrics: bool = False, virtual: VirtualTime | None = None):
    prompts = synthetic_prompts(num_prompts, LengthRange(3, 9), LengthRange(tokens, tokens), seed=1)
    options = RequestOptions(model="fake", timeout_s=timeout_s)
    pacing = {} if virtual is None else {"clock": virtual.clock, "sleep": virtual.sleep}

    async def go():
        async with HttpTarget(url, options) as target:
            metrics_url = target.metrics_url if metrics else None
            return await run_load(target, prompts, load, metrics_url, 0.05, progress=False, **pacing)

    return asyncio.run(go())


def test_closed_loop_completes_all_and_measures_the_fake_delays():
    first, gap, tokens = 0.15, 0.03, 5
    with FakeOpenAIServer(FakeBehavior(first_token_delay_s=first, inter_token_delay_s=gap)) as server:
        result = run(server.url, LoadSpec(num_requests=8, concurrency=4), num_prompts=8, tokens=tokens,
                     metrics=True)
        assert server.arrivals == 8
        assert server.max_in_flight == 4
    summary = summarize(result)
    assert (summary["sent"], summary["completed"], summary["failed"]) == (8, 8, 0)
    assert summary["output_tokens"] == 8 * tokens
    assert summary["req_per_s"] == pytest.approx(8 / result.duration_s)
    assert summary["output_tok_per_s"] == pytest.approx(8 * tokens / result.duration_s)
    one_request = first + (tokens - 1) * gap
    assert result.duration_s >= 2 * one_request - EPS  # two rounds of four
    for record in result.records:
        assert record.ttft >= first - EPS and record.e2e >= one_request - EPS
        assert len(record.itls) == tokens - 1
        assert record.tpot == pytest.approx((record.e2e - record.ttft) / (tokens - 1))
        # the first chunk is the TTFT, the later ones give the ITLs, the end comes after the last chunk
        assert record.ttft == record.chunk_times[0] <= record.chunk_times[-1] <= record.e2e
    samples = latency_samples(result.records)
    assert len(samples["itl"]) == 8 * (tokens - 1)
    assert summary["ttft_ms"]["p90"] == pytest.approx(percentile([t * 1000 for t in samples["ttft"]], 90))
    assert summary["e2e_ms"]["p50"] <= summary["e2e_ms"]["p90"] <= summary["e2e_ms"]["p99"]
    assert result.metrics.times, result.metrics.note
    assert max(result.metrics.values["pagedray:num_requests_running"]) >= 1


def test_open_loop_sends_on_the_seeded_poisson_schedule():
    load = LoadSpec(num_requests=10, rate=20.0, seed=3)
    with FakeOpenAIServer(FakeBehavior(first_token_delay_s=0.01, inter_token_delay_s=0.01)) as server:
        result = run(server.url, load, num_prompts=10, tokens=3, virtual=VirtualTime())
        assert server.arrivals == 10
    arrivals = poisson_arrivals(20.0, 10, 3)
    assert [r.index for r in result.records] == list(range(10))
    assert all(r.ok for r in result.records)
    assert [r.send_s for r in result.records] == pytest.approx(arrivals)


def test_poisson_arrivals_are_seeded_and_have_the_right_mean_gap():
    times = poisson_arrivals(4.0, 2001, seed=7)
    assert times == poisson_arrivals(4.0, 2001, seed=7)
    assert times != poisson_arrivals(4.0, 2001, seed=8)
    assert times[0] == 0.0 and all(b > a for a, b in zip(times, times[1:]))
    # mean of 2000 exponential gaps with mean 0.25: standard error 0.25 / sqrt(2000) = 0.0056
    assert times[-1] / 2000 == pytest.approx(0.25, abs=4 * 0.0056)
    assert poisson_arrivals(math.inf, 3, seed=0) == [0.0, 0.0, 0.0]


def test_open_loop_infinite_rate_sends_everything_at_once():
    with FakeOpenAIServer(FakeBehavior(first_token_delay_s=0.2, inter_token_delay_s=0.01)) as server:
        result = run(server.url, LoadSpec(num_requests=6, rate=math.inf), num_prompts=6, tokens=2)
        assert server.max_in_flight == 6
    assert sum(r.ok for r in result.records) == 6


def test_open_loop_duration_bound_sends_exactly_the_arrivals_before_it():
    load = LoadSpec(num_requests=1000, rate=10.0, duration_s=0.6, seed=1)
    expected = sum(1 for t in poisson_arrivals(10.0, 1000, 1) if t < 0.6)
    with FakeOpenAIServer(FakeBehavior(first_token_delay_s=0.01)) as server:
        result = run(server.url, load, num_prompts=5, tokens=2, virtual=VirtualTime())
        assert server.arrivals == expected
    assert len(result.records) == expected
    assert [r.prompt_index for r in result.records] == [i % 5 for i in range(expected)]
    assert result.records[-1].send_s < 0.6 <= poisson_arrivals(10.0, 1000, 1)[expected]


def test_closed_loop_duration_bound_stops_taking_requests():
    # each request takes 0.1 + 4 * 0.075 = 0.4 s: rounds start at ~0 and ~0.4 (< 0.6), not at ~0.8
    behavior = FakeBehavior(first_token_delay_s=0.1, inter_token_delay_s=0.075)
    with FakeOpenAIServer(behavior) as server:
        result = run(server.url, LoadSpec(num_requests=100, concurrency=2, duration_s=0.6), 10, tokens=5)
        assert server.arrivals == 4
    assert len(result.records) == 4 and all(r.ok for r in result.records)


def test_failures_are_counted_by_cause():
    faults = ("ok", "429", "ok", "500", "stall", "stream_error", "disconnect", "ok")
    behavior = FakeBehavior(first_token_delay_s=0.01, inter_token_delay_s=0.01, faults=faults, stall_s=1.0)
    with FakeOpenAIServer(behavior) as server:
        result = run(server.url, LoadSpec(num_requests=16, concurrency=4), 16, tokens=4, timeout_s=0.4)
        assert server.arrivals == 16
    summary = summarize(result)
    # 16 arrivals cycle the 8 faults exactly twice, whatever order the requests arrived in
    assert summary["completed"] == 6
    assert summary["failed_by_cause"] == {"connection": 2, "http_429": 2, "http_500": 2,
                                          "stream_error": 2, "timeout": 2}
    assert summary["output_tokens"] == 6 * 4
    assert len(latency_samples(result.records)["e2e"]) == 6
    http = [r for r in result.records if r.error == "http_429"]
    assert all("fake 429" in r.error_detail for r in http)


def test_chat_endpoint_skips_the_role_only_chunk():
    with FakeOpenAIServer(FakeBehavior(first_token_delay_s=0.1, inter_token_delay_s=0.01)) as server:
        prompts = synthetic_prompts(2, LengthRange(4, 4), LengthRange(3, 3), seed=0)

        async def go():
            async with HttpTarget(server.url + "/v1/", RequestOptions(model="m", endpoint="chat")) as target:
                return await run_load(target, prompts, LoadSpec(num_requests=2, concurrency=1), progress=False)

        result = asyncio.run(go())
    for record in result.records:
        assert record.ok and len(record.chunks) == 3 and record.output_tokens == 3
        assert record.ttft >= 0.1 - EPS  # the immediate role chunk carries no text and is not the first token
