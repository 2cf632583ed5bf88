"""``FailoverEngineClient`` over fake engine replicas whose tokens depend only on (seed, position), as the
real engine's greedy and seeded draws do: a stream whose replica dies (actor error) or whose engine fails
(an ``engine_failed`` output) goes on through a continuation (the prompt, the tokens already streamed as
``resume_tokens``, one n=1 request per unfinished sample with its sibling seed) and the caller sees the
undisturbed run's tokens, the prompt once, each sample finished once. Failovers are bounded, a request's
own error is never retried, and the count reaches /metrics (``pagedray:request_failovers_total``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from pagedray.cluster import SamplingParams
from pagedray.cluster.outputs import (
    CompletionOutput,
    EngineDeadError,
    EngineDrainingError,
    QueueFullError,
    RequestOutput,
)
from pagedray.deploy.openai.metrics import ServerMetrics
from pagedray.deploy.serve import failover
from pagedray.deploy.serve.failover import BACKOFF_S, MAX_FAILOVERS, REFUSED_RETRY_S, FailoverEngineClient
from ray.exceptions import ActorDiedError

PROMPT = [5, 6, 7]


def token(seed: int | None, index: int, position: int) -> int:
    """What a replica samples for sample ``index`` at output ``position`` (the sibling seed rule: seed + i)."""
    return ((0 if seed is None else seed + index) * 31 + position * 7) % 97


@dataclass
class FakeReplicas:
    """Each ``generate`` call is served by the next replica: it streams ``die_after`` outputs (one token
    per unfinished sample each), then dies as ``death`` says (None: runs to the end)."""

    plan: list[tuple[int | None, str | None]]
    calls: list[tuple[str, list[int], SamplingParams, list[int]]] = field(default_factory=list)

    async def generate(self, request_id, prompt_token_ids, params, resume_tokens=(), lora=None, session=None,
                           tenant=None):
        die_after, death = self.plan[len(self.calls)] if len(self.calls) < len(self.plan) else (None, None)
        self.calls.append((request_id, list(prompt_token_ids), params, list(resume_tokens)))
        produced = [len(resume_tokens)] * params.n
        first, step = True, 0
        while True:
            if die_after is not None and step == die_after:
                if death == "actor":
                    raise ActorDiedError()
                if death == "dead-at-intake":
                    raise EngineDeadError("engine dead: a step failed")
                if death == "queue-full":
                    raise QueueFullError("64 requests are waiting (max_queued_requests); retry later")
                if death == "draining":
                    raise EngineDrainingError("the engine is draining")
                yield RequestOutput(request_id, [CompletionOutput(i, [], None, "error") for i in range(params.n)],
                                    finished=True, error="engine dead: a step failed", engine_failed=True)
                return
            outputs = []
            for i in range(params.n):
                if produced[i] < params.max_tokens:
                    outputs.append(CompletionOutput(i, [token(params.seed, i, produced[i])], None,
                                                    "length" if produced[i] + 1 == params.max_tokens else None))
                    produced[i] += 1
            done = all(p == params.max_tokens for p in produced)
            yield RequestOutput(request_id, outputs, done, prompt_token_ids=list(prompt_token_ids) if first else None,
                                num_cached_prompt_tokens=0 if first else 2)
            first, step = False, step + 1
            if done:
                return
            await asyncio.sleep(0)


def _collect(client, params) -> tuple[dict[int, list[int]], dict[int, list[str]], int]:
    async def run():
        tokens, finishes, prompts = {}, {}, 0
        async for out in client.generate("req", PROMPT, params):
            prompts += out.prompt_token_ids is not None
            for c in out.outputs:
                tokens.setdefault(c.index, []).extend(c.token_ids)
                if c.finish_reason is not None:
                    finishes.setdefault(c.index, []).append(c.finish_reason)
        return tokens, finishes, prompts

    return asyncio.run(run())


def _client(replicas, metrics=None):
    sleeps = []

    async def sleep(seconds):
        sleeps.append(seconds)

    on_failover = metrics.failovers.inc if metrics is not None else (lambda: None)
    return FailoverEngineClient(replicas, on_failover=on_failover, sleep=sleep), sleeps


@pytest.mark.parametrize("death", ["actor", "engine"])
def test_a_lost_stream_continues_with_the_undisturbed_tokens(death):
    params = SamplingParams(temperature=0, max_tokens=8)
    replicas = FakeReplicas([(3, death)])
    metrics = ServerMetrics("m")
    client, sleeps = _client(replicas, metrics)
    tokens, finishes, prompts = _collect(client, params)
    assert tokens == {0: [token(None, 0, p) for p in range(8)]} and finishes == {0: ["length"]} and prompts == 1
    (rid, prompt, first_params, resume), (rid2, prompt2, cont_params, resume2) = replicas.calls
    assert (rid, resume) == ("req", []) and prompt2 == prompt == PROMPT and cont_params == params
    assert rid2 == "req:failover1" and resume2 == tokens[0][:3]
    assert sleeps == [BACKOFF_S[0]]
    assert 'pagedray:request_failovers_total{model_name="m"} 1.0' in metrics.render().decode()


def test_each_unfinished_sample_continues_with_its_own_seed():
    params = SamplingParams(temperature=0.8, seed=11, n=3, max_tokens=10)
    replicas = FakeReplicas([(4, "engine"), (2, "actor")])    # the first continuation is lost too
    client, _ = _client(replicas)
    tokens, finishes, prompts = _collect(client, params)
    assert tokens == {i: [token(11, i, p) for p in range(10)] for i in range(3)}
    assert finishes == {i: ["length"] for i in range(3)} and prompts == 1
    continuations = replicas.calls[1:]
    assert [(c[0], c[2].n, c[2].seed, len(c[3])) for c in continuations[:3]] == [
        ("req:failover1:0", 1, 11, 4), ("req:failover1:1", 1, 12, 4), ("req:failover1:2", 1, 13, 4)]
    # sample 0's continuation died after 2 tokens: the second failover resumes it from 6 tokens
    assert ("req:failover2:0", 6) in [(c[0], len(c[3])) for c in continuations[3:]]


def test_only_the_last_output_of_a_continued_request_says_finished():
    """Each per-sample continuation ends its own stream finished; the merged stream is finished once, at the end."""
    replicas = FakeReplicas([(3, "actor")])
    client, _ = _client(replicas)

    async def flags():
        return [out.finished async for out in client.generate("req", PROMPT, SamplingParams(seed=4, n=2, max_tokens=6))]

    finished = asyncio.run(flags())
    assert finished[-1] and not any(finished[:-1])


@pytest.mark.parametrize("n", [1, 2])
def test_a_continuation_the_survivors_refuse_for_a_moment_is_sent_again(n):
    """The survivors' admission queues are full (then one drains) when the continuation comes: it is sent
    again every REFUSED_RETRY_S until a replica takes it, and the stream stays exact (no extra failover)."""
    params = SamplingParams(temperature=0.7, seed=3, n=n, max_tokens=7)
    refusals = [(0, "queue-full"), (0, "draining")] if n == 1 else [(0, "queue-full")]
    replicas = FakeReplicas([(3, "actor")] + refusals)
    metrics = ServerMetrics("m")
    client, sleeps = _client(replicas, metrics)
    tokens, finishes, prompts = _collect(client, params)
    assert tokens == {i: [token(3, i, p) for p in range(7)] for i in range(n)} and prompts == 1
    assert finishes == {i: ["length"] for i in range(n)}
    assert sleeps == [BACKOFF_S[0]] + [REFUSED_RETRY_S] * len(refusals)
    first_continuation = "req:failover1" if n == 1 else "req:failover1:0"
    assert [c[0] for c in replicas.calls[1:]].count(first_continuation) == len(refusals) + 1
    assert 'pagedray:request_failovers_total{model_name="m"} 1.0' in metrics.render().decode()


def test_a_continuation_refused_past_the_placement_timeout_ends_the_request():
    replicas = FakeReplicas([(2, "actor")] + [(0, "queue-full")] * 3)
    client = FailoverEngineClient(replicas, placement_timeout_s=REFUSED_RETRY_S / 2)
    with pytest.raises(EngineDeadError, match="every engine replica refused the request's continuation"):
        _collect(client, SamplingParams(max_tokens=4))
    assert [c[0] for c in replicas.calls] == ["req", "req:failover1"]


def test_failovers_are_bounded_and_the_last_error_reaches_the_caller():
    params = SamplingParams(temperature=0, max_tokens=50)
    replicas = FakeReplicas([(2, "actor")] + [(1, "dead-at-intake")] * MAX_FAILOVERS)
    client, sleeps = _client(replicas)
    with pytest.raises(EngineDeadError):
        _collect(client, params)
    assert len(replicas.calls) == MAX_FAILOVERS + 1 and sleeps == list(BACKOFF_S[:MAX_FAILOVERS])


def test_the_last_engine_failure_is_passed_through_as_an_error_output():
    replicas = FakeReplicas([(1, "engine")] * (MAX_FAILOVERS + 1))
    client, _ = _client(replicas)

    async def last():
        outs = [out async for out in client.generate("req", PROMPT, SamplingParams(max_tokens=9))]
        return outs[-1]

    out = asyncio.run(last())
    assert out.error.startswith("engine dead") and out.outputs[0].finish_reason == "error"
    assert len(replicas.calls) == MAX_FAILOVERS + 1


def test_a_requests_own_error_is_not_retried():
    class OwnError(FakeReplicas):
        async def generate(self, request_id, prompt_token_ids, params, resume_tokens=(), lora=None, session=None,
                           tenant=None):
            self.calls.append(request_id)
            yield RequestOutput(request_id, [CompletionOutput(0, [], None, "error")], True,
                                error="grammar: the matcher failed")

    replicas = OwnError([])
    client, _ = _client(replicas)
    _, finishes, _ = _collect(client, SamplingParams(max_tokens=4))
    assert finishes == {0: ["error"]} and replicas.calls == ["req"]


def test_a_continuation_nobody_takes_ends_the_request_after_the_placement_timeout():
    class Silent(FakeReplicas):
        async def generate(self, request_id, prompt_token_ids, params, resume_tokens=(), lora=None, session=None,
                           tenant=None):
            if self.calls:
                self.calls.append(request_id)
                await asyncio.Event().wait()           # never placed: no output ever comes
            self.calls.append(request_id)
            raise ActorDiedError()
            yield

    replicas = Silent([])
    client = FailoverEngineClient(replicas, placement_timeout_s=0.05)
    with pytest.raises(EngineDeadError, match="no engine replica took the request's continuation"):
        _collect(client, SamplingParams(max_tokens=4))
    assert replicas.calls == ["req", "req:failover1"]      # not retried


@pytest.mark.parametrize("death", ["actor", "engine"])
def test_a_stream_lost_while_the_app_is_deleted_ends_at_once_without_a_continuation(death):
    """``pagedray serve`` stopping (``serve delete``): Serve kills the engine replica at graceful_shutdown_s and
    no replica will take a continuation; waiting for one kept the stream open until Ray was shut down under
    it (a cut connection). The stream ends with the error instead, its tokens so far delivered."""
    asked = []

    async def deleting():
        asked.append(True)
        return True

    replicas = FakeReplicas([(3, death)])
    client = FailoverEngineClient(replicas, app_deleting=deleting)
    streamed = []

    async def run():
        async for out in client.generate("req", PROMPT, SamplingParams(temperature=0, max_tokens=8)):
            streamed.extend(t for c in out.outputs for t in c.token_ids)

    with pytest.raises(EngineDeadError, match="the app is being deleted"):
        asyncio.run(run())
    assert streamed == [token(None, 0, p) for p in range(3)]
    assert [c[0] for c in replicas.calls] == ["req"] and asked == [True]


UNDISTURBED_5 = [token(None, 0, p) for p in range(5)]


def test_the_apps_status_is_asked_only_when_a_replica_is_lost():
    asked = []

    async def not_deleting():
        asked.append(True)
        return False

    client = FailoverEngineClient(FakeReplicas([]), app_deleting=not_deleting)
    assert _collect(client, SamplingParams(temperature=0, max_tokens=5))[0] == {0: UNDISTURBED_5}
    assert asked == []
    replicas = FakeReplicas([(2, "actor")])          # a redeploy or a scale-down: the stream goes on
    client = FailoverEngineClient(replicas, app_deleting=not_deleting)
    assert _collect(client, SamplingParams(temperature=0, max_tokens=5))[0] == {0: UNDISTURBED_5}
    assert asked == [True] and len(replicas.calls) == 2


class _Status:
    def __init__(self, apps):
        self.applications = apps


class _App:
    def __init__(self, status):
        self.status = status


@pytest.mark.parametrize("status, deleting", [
    (_Status({"app": _App("DELETING")}), True),
    (_Status({}), True),                                  # gone already
    (_Status({"app": _App("RUNNING")}), False),
    (_Status({"app": _App("DEPLOYING")}), False),         # a redeploy
    (None, False),                                        # Serve's status cannot be had: fail over as before
])
def test_app_being_deleted_reads_serves_status_of_the_app(monkeypatch, status, deleting):
    from ray import serve

    def fake_status():
        if status is None:
            raise RuntimeError("the controller is gone")
        return status

    monkeypatch.setattr(serve, "status", fake_status)
    assert asyncio.run(failover.app_being_deleted("app")) is deleting
