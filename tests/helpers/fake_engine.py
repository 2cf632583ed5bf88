"""TEST DOUBLE of the engine for HTTP-layer unit tests (not a model): scripted token streams.

``ScriptedEngine.generate`` yields RequestOutput deltas like the real AsyncEngine: sample i of a
request emits ``script[(i + k) % len(script)]`` for k = 0, 1, ... one token per output, until
``max_tokens`` ("length") or a token in ``stop_token_ids`` / ``eos`` ("stop"). Logprobs are fake
but well-formed (``-0.5 * (k + 1)``); prompt logprobs too (``-0.25 * i`` for prompt token i, rank i,
top k: the token itself, then ``k - 1`` others). It records every call, and which requests were closed before
they finished (``aborted``), so tests can check that bad input never reaches the engine and that
stopping early aborts.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pagedray.cluster.outputs import (
    CompletionOutput,
    EngineDeadError,
    QueueFullError,
    RequestOutput,
    TokenLogprob,
)
from pagedray.deploy.openai.metrics import ReplicaState


@dataclass
class FakeStats:
    num_running: int
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_hit_rate: float = 0.0
    num_preemptions_total: int = 0
    num_free_blocks: int = 100


@dataclass
class ScriptedEngine:
    script: list[int]
    eos_token_id: int = 2
    reject_with: Exception | None = None
    dead: bool = False
    delay_s: float = 0.0
    cached_prompt_tokens: int = 0   # reported as the prefix-cache hit of every request
    calls: list[tuple[str, list[int], object]] = field(default_factory=list)
    loras: list = field(default_factory=list)    # the lora argument of each call, in order
    sessions: list = field(default_factory=list)  # the session argument of each call, in order
    tenants: list = field(default_factory=list)   # the tenant argument of each call, in order
    aborted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    active: set[str] = field(default_factory=set)

    def _token(self, k: int, sample: int) -> int:
        return self.script[(sample + k) % len(self.script)]

    def _step(self, k: int, params, done: list[bool]) -> list[CompletionOutput]:
        outs = []
        for i in range(params.n):
            if done[i]:
                continue
            token = self._token(k, i)
            reason = None
            stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else {self.eos_token_id})
            if token in stop_ids:
                reason = "stop"
            elif k + 1 >= params.max_tokens:
                reason = "length"
            done[i] = reason is not None
            logprobs = None
            if params.logprobs is not None:
                top = [(self._token(k, i + j), -0.5 * (k + 1) - j) for j in range(params.logprobs)]
                logprobs = [TokenLogprob(token, -0.5 * (k + 1), top)]
            outs.append(CompletionOutput(i, [token], logprobs, reason))
        return outs

    def _prompt_logprobs(self, prompt_token_ids, params) -> list | None:
        k = params.prompt_logprobs
        if k is None:
            return None
        entries = [None]
        for i, token in enumerate(prompt_token_ids[1:], start=1):
            top = [(token, -0.25 * i)] + [(self.script[j % len(self.script)], -0.25 * i - j) for j in range(1, k)]
            entries.append(TokenLogprob(token, -0.25 * i, top[:k], rank=i))
        return entries

    async def generate(self, request_id, prompt_token_ids, params, lora=None, session=None, tenant=None):
        if self.reject_with is not None:
            raise self.reject_with
        if self.dead:
            raise EngineDeadError("engine is dead")
        self.calls.append((request_id, list(prompt_token_ids), params))
        self.loras.append(lora)
        self.sessions.append(session)
        self.tenants.append(tenant)
        self.active.add(request_id)
        done = [False] * params.n
        try:
            for k in range(params.max_tokens):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                outs = self._step(k, params, done)
                yield RequestOutput(request_id, outs, all(done),
                                    num_cached_prompt_tokens=self.cached_prompt_tokens,
                                    prompt_token_ids=list(prompt_token_ids) if k == 0 else None,
                                    prompt_logprobs=self._prompt_logprobs(prompt_token_ids, params) if k == 0 else None)
                if all(done):
                    break
            self.finished.append(request_id)
        finally:
            self.active.discard(request_id)
            if request_id not in self.finished:
                self.aborted.append(request_id)

    async def stats(self) -> FakeStats:
        return FakeStats(num_running=len(self.active))

    async def replica_states(self) -> list[ReplicaState]:
        reason = "rank 1 is dead" if self.dead else ""
        return [ReplicaState("fake-replica", await self.stats(), not self.dead, reason)]

    async def check_lora(self, lora) -> None:
        """Refuses an adapter whose folder ends with "bad" (as the engine's check would, naming it)."""
        if lora.path.endswith("bad"):
            raise ValueError(f"lora adapter {lora.name!r}: rank 99 is over max_lora_rank 16")

    async def check_ready(self) -> None:
        if self.dead:
            raise EngineDeadError("rank 1 is dead")


def queue_full() -> QueueFullError:
    return QueueFullError("the waiting queue is full (1 requests)")
