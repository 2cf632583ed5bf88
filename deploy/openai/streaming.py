"""The ingress side of one generation: engine outputs -> per-choice text deltas.

``stream_choices`` consumes the engine's RequestOutput deltas for one prompt and yields
``ChoiceDelta`` objects carrying text that is safe to show: incrementally detokenized, with any text
that could begin a stop string held back. When every choice has finished (finish reason from the
engine, or a stop string seen here) it stops consuming, which cancels the engine stream and so
aborts the request in the engine: its KV blocks are freed within one step.

Decisions: docs/design/deploy.md, ``pagedray.deploy.openai.streaming``.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Protocol

from pagedray.cluster.outputs import CompletionOutput, EngineError, RequestOutput, TokenLogprob
from pagedray.workers.contract.sampling_params import SamplingParams

from .detokenizer import IncrementalDetokenizer, StopStringMatcher
from .validation import PreparedRequest


class EngineRequestError(EngineError):
    """The engine finished this request with finish_reason 'error'."""


class EngineClient(Protocol):
    """What the ingress needs from the engine (the Serve engine deployment, or a test double)."""

    def generate(self, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, lora=None, session=None, tenant=None
                 ) -> AsyncIterator[RequestOutput]: ...   # lora: a LoRARequest; session, tenant: names (str)

    async def stats(self): ...

    async def replica_states(self) -> list: ...   # list[metrics.ReplicaState]: every engine replica known

    async def check_ready(self) -> None: ...   # alive and taking requests (/health), else raises

    async def check_lora(self, lora) -> None: ...   # ValueError naming the problem unless the engine can serve it


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    # on a choice's first delta when the request asked for prompt logprobs (None for prompt token 0)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # with finish_reason "stop": the stop string that matched or the stop token id; None for EOS
    stop_reason: str | int | None = None


@dataclass
class RequestTimer:
    """Latency bookkeeping for one request (seconds, time.monotonic)."""

    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    inter_token: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0   # prompt tokens whose KV came from the prefix cache
    kv_block_seconds: float = 0.0   # KV blocks held, integrated over the engine's seconds (usage)

    def on_tokens(self, count: int) -> None:
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
        elif self.last_token is not None:
            self.inter_token.append(now - self.last_token)
        self.last_token = now
        self.completion_tokens += count


class _ChoiceState:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...], min_tokens: int = 0,
                 skip_special_tokens: bool = True) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self.matcher = StopStringMatcher(stop)
        self.finished = False
        self.sent_prompt_logprobs = False
        self.unprotected_after = min_tokens   # the first min_tokens tokens' text is never matched
        self.num_tokens = 0

    def advance(self, out: CompletionOutput, hidden_ids: frozenset[int],
                stop_token_ids: frozenset[int] = frozenset()) -> ChoiceDelta:
        visible = out.token_ids
        if out.finish_reason == "stop" and visible and visible[-1] in hidden_ids:
            visible = visible[:-1]
        protected = max(0, min(len(visible), self.unprotected_after - self.num_tokens))
        self.num_tokens += len(out.token_ids)
        text = self.detokenizer.add(visible[:protected]) if protected else ""
        text += self.matcher.feed(self.detokenizer.add(visible[protected:]))
        finish_reason = None
        if self.matcher.stopped:
            finish_reason = "stop"
        elif out.finish_reason is not None:
            text += self.matcher.feed(self.detokenizer.flush())
            text += self.matcher.flush()
            finish_reason = "stop" if self.matcher.stopped else out.finish_reason
        self.finished = finish_reason is not None
        stop_reason = self.matcher.matched
        if stop_reason is None and finish_reason == "stop" and out.token_ids and out.token_ids[-1] in stop_token_ids:
            stop_reason = out.token_ids[-1]
        return ChoiceDelta(out.index, text, list(out.token_ids), out.logprobs, finish_reason,
                           stop_reason=stop_reason if finish_reason == "stop" else None)


async def stream_choices(engine: EngineClient, request_id: str, prepared: PreparedRequest, tokenizer,
                         timer: RequestTimer, tenant: str | None = None) -> AsyncIterator[list[ChoiceDelta]]:
    """Yield, per engine step, the deltas of the choices that advanced (see the module docstring); ``tenant``:
    the caller's tenant (its API key's, ``deploy/serve/tenants.py``)."""
    params = prepared.params
    states = [_ChoiceState(tokenizer, prepared.prompt_token_ids, prepared.stop, params.min_tokens,
                           not prepared.keep_special_tokens) for _ in range(params.n)]
    hidden_ids = stop_ids = frozenset(params.stop_token_ids)
    if prepared.keep_special_tokens:   # the text keeps special tokens: not the EOS that ended the choice
        hidden_ids |= frozenset(tokenizer.all_special_ids)
    timer.prompt_tokens += len(prepared.prompt_token_ids)
    prompt_logprobs, cached, kv_seen = None, 0, 0.0
    async with aclosing(engine.generate(request_id, prepared.prompt_token_ids, params, lora=prepared.lora,
                                        session=prepared.session, tenant=tenant)) as outputs:
        async for output in outputs:
            if output.error is not None or any(o.finish_reason == "error" for o in output.outputs):
                raise EngineRequestError(output.error or "the engine failed while generating")
            if output.num_cached_prompt_tokens > cached:   # first admission's count (a preemption may change it)
                timer.cached_prompt_tokens += output.num_cached_prompt_tokens - cached
                cached = output.num_cached_prompt_tokens
            if output.kv_block_seconds < kv_seen:   # a continuation on another replica counts from 0 again
                kv_seen = 0.0
            timer.kv_block_seconds += output.kv_block_seconds - kv_seen
            kv_seen = output.kv_block_seconds
            prompt_logprobs = output.prompt_logprobs or prompt_logprobs
            deltas = [states[o.index].advance(o, hidden_ids, stop_ids) for o in output.outputs
                      if not states[o.index].finished]
            for delta in deltas:
                if prompt_logprobs is not None and not states[delta.index].sent_prompt_logprobs:
                    delta.prompt_logprobs = prompt_logprobs
                    states[delta.index].sent_prompt_logprobs = True
            new_tokens = sum(len(d.token_ids) for d in deltas)
            if new_tokens:
                timer.on_tokens(new_tokens)
            if deltas:
                yield deltas
            if all(state.finished for state in states):
                return
    if not all(state.finished for state in states):
        raise EngineRequestError("the engine stream ended before every choice finished")


_END = object()


async def merge_streams(streams: list[AsyncIterator], window: int | None = None) -> AsyncIterator[tuple[int, object]]:
    """Interleave several async iterators as (stream index, item); closes them all on exit.

    With ``window``, at most that many streams are iterated at once (an async generator only starts its
    work when first iterated); the next one starts, in order, when one ends."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async with aclosing(stream) as it:
                async for item in it:
                    await queue.put((i, item))
        except Exception as exc:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, _END))

    waiting = collections.deque(enumerate(streams))
    tasks: list[asyncio.Task] = []

    def start_next() -> None:
        i, stream = waiting.popleft()
        tasks.append(asyncio.create_task(pump(i, stream)))

    for _ in range(len(streams) if window is None else min(window, len(streams))):
        start_next()
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is _END:
                remaining -= 1
                if waiting:
                    start_next()
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, stream in waiting:   # never started: nothing was sent to the engine
            await stream.aclose()


class PrefetchedStream:
    """An async iterator whose first item has already been awaited (so admission errors surface
    before a response starts). ``aclose()`` closes the underlying stream even if never iterated."""

    def __init__(self, stream: AsyncIterator) -> None:
        self._stream = stream
        self._first: list = []

    async def prefetch(self) -> bool:
        """Await the first item; False when the stream is empty."""
        try:
            self._first.append(await anext(self._stream))
        except StopAsyncIteration:
            return False
        return True

    def __aiter__(self) -> PrefetchedStream:
        return self

    async def __anext__(self):
        if self._first:
            return self._first.pop()
        return await anext(self._stream)

    async def aclose(self) -> None:
        await self._stream.aclose()
