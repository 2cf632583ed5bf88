"""Streams that survive a lost engine replica: the ingress continues them on another replica.

``FailoverEngineClient`` wraps the ingress's client of the engine deployment (``HandleEngineClient``;
several replicas, or autoscaling). When the replica serving a request is lost mid-stream (its actor
died or its node went away: ``RayActorError``; its engine died: ``EngineDeadError`` or an output marked
``engine_failed``), the request is submitted again, as a continuation, through the same handle (Serve
routes it to a live replica): the prompt, the sampling parameters, and per sample the output tokens
already streamed (``resume_tokens``: ``Engine.add``). The new replica computes them with the prompt
and samples on from the next position, so greedy and seeded samples continue token for token as the lost
run would have (seeded draws depend on (seed, position); penalties and grammars see the resumed tokens).
Everything above this client (detokenizer, stop strings, tool and reasoning parsers, usage) sees one
stream: continuation outputs carry no prompt fields, and usage counts the prompt once.

- ``n > 1``: each unfinished sample continues as a request of its own (n=1, its sibling seed ``seed + i``,
  its own tokens as ``resume_tokens``), merged back under its index; a sample that had finished is not sent
  again. Through Serve these are several ``generate`` calls of one ingress request at once: the engine
  deployment's router must place each of them (``routing/router.py``: FIFO fulfilment; Serve's exact
  matching by request id left the second one unplaced and spinning, issue #39).
- Bounded: at most ``MAX_FAILOVERS`` continuations per request, the k-th after ``BACKOFF_S[k-1]`` seconds
  (the first at once: Serve's router drops a replica whose actor died at the first failed call), each
  sample's continuation placed within ``PLACEMENT_TIMEOUT_S`` (with one replica, it waits for Serve to
  replace it). A continuation refused before its first output because the replica's admission queue is
  full (``QueueFullError``) or it is draining is sent again every ``REFUSED_RETRY_S`` within that time: the
  survivors of a lost replica may be full for a moment, and the stream must not be lost for it.
  A request that cannot be placed ends as before: the error reaches the stream (an SSE error event).
- Never for a request's own failure (an ``error`` from its grammar or its logits, a 4xx): that would
  fail again the same way.
- Never while the app is being deleted (``serve delete``, ``pagedray serve`` stopping; ``app_deleting``, asked
  at each failover: Serve's status of the app says DELETING, or the app is gone): no replica will take the
  continuation, and waiting for one kept the stream open until Ray was shut down under it (a cut
  connection instead of an SSE error event). A redeploy or a scale-down still fails over.
- Unseeded sampling continues too, but not reproducibly (it never was).
- Migration without re-prefill: a replica that Serve removes (scale-down, redeploy) hands its requests over
  with their KV blocks (``AsyncEngine.drain(hand_over, pack)``: prompt and output so far, per sample when n > 1,
  the bytes inside the hand-over output, since the replica's own object-store entries go with it); each
  continuation imports its sample's blocks (``kv``) and computes only the last partial block. A crashed replica's
  KV is gone: its continuations compute their prompt again, or pull it from a peer that holds it (``kv_pull.py``).

- Planned moves (rebalancing between live replicas, ``rebalance.py``): an output marked ``moved_from`` ends the
  request on a replica that is alive and handed it over on purpose (with its blocks, ``kv``). Its continuation
  is sent at once, with ``exclude`` naming that replica (the router places it on another one), and is not a
  failover: at most ``MAX_MOVES`` of them per request, which do not use up ``MAX_FAILOVERS``.

``pagedray:request_failovers_total`` counts failovers (``on_failover``): one per request and lost replica,
whatever its n; ``pagedray:request_moves_total`` counts planned moves (``on_move``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import replace

from pagedray.cluster.outputs import (
    CompletionOutput,
    EngineDeadError,
    EngineDrainingError,
    QueueFullError,
    RequestOutput,
)
from pagedray.cluster.request import sibling_seed
from pagedray.workers.contract.sampling_params import SamplingParams
from ray.exceptions import RayActorError
from ray.serve.exceptions import ReplicaUnavailableError

from ..openai.errors import engine_error_message
from ..openai.streaming import merge_streams

MAX_FAILOVERS = 3
MAX_MOVES = 8   # planned moves of one request (rebalance.py) that are not failovers; a later one counts as one
BACKOFF_S = (0.0, 1.0, 4.0)
# a continuation that a full admission queue or a draining replica refuses is sent again after this
REFUSED_RETRY_S = 0.5
# a continuation's first output must come within this (Serve may be starting the replica that takes it)
PLACEMENT_TIMEOUT_S = 180.0
APP_STATUS_TIMEOUT_S = 10.0   # Serve's status of the app, asked at each failover (``app_being_deleted``)
REPLICA_LOST = (RayActorError, ReplicaUnavailableError, EngineDeadError)


class NotPlaced(EngineDeadError):
    """No replica took a continuation within the placement timeout: the request ends (not retried)."""


class ReplicaLost(Exception):
    """An output said the engine failed under the request (``RequestOutput.engine_failed``)."""


async def _never_deleting() -> bool:
    return False


async def app_being_deleted(app_name: str, timeout_s: float = APP_STATUS_TIMEOUT_S) -> bool:
    """Serve's status of ``app_name`` says DELETING, or the app is gone. False when Serve does not answer
    within ``timeout_s`` (or at all): a failover is then tried as before."""
    from ray import serve

    def deleting() -> bool:
        status = serve.status().applications.get(app_name)
        return status is None or status.status == "DELETING"

    try:
        return await asyncio.wait_for(asyncio.to_thread(deleting), timeout_s)
    except Exception:  # noqa: BLE001 - a status that cannot be had never ends a stream
        return False


class FailoverEngineClient:
    def __init__(self, inner, on_failover: Callable[[], None] = lambda: None, max_failovers: int = MAX_FAILOVERS,
                 sleep: Callable[[float], object] = asyncio.sleep,
                 placement_timeout_s: float = PLACEMENT_TIMEOUT_S,
                 app_deleting: Callable[[], Awaitable[bool]] = _never_deleting,
                 on_move: Callable[[], None] = lambda: None) -> None:
        self._inner = inner
        self._app_deleting = app_deleting
        self._placement_timeout_s = placement_timeout_s
        self._on_failover = on_failover
        self._on_move = on_move
        self._max_failovers = max_failovers
        self._sleep = sleep

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       lora=None, session=None, tenant=None, resume_tokens: list[int] = (), kv=None
                       ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as one stream, its lost parts continued (at most ``max_failovers`` times).
        ``resume_tokens`` / ``kv`` (n=1): the request already produced these tokens elsewhere (a prefill replica,
        ``disaggregation.py``), whose prompt blocks ``kv`` brings; its first stream starts after them.

        Invariants: each sample's tokens reach the caller once and in order (``produced[i]`` is exactly what
        was yielded for sample i); each sample's finish is yielded once; the prompt fields come from the
        first replica only; an output is ``finished`` only once every sample is done."""
        produced: list[list[int]] = [[] for _ in range(params.n)]     # per sample: tokens streamed so far
        done = [False] * params.n
        cached, failovers, moves, handed_kv, moved_from = 0, 0, 0, None, None
        if resume_tokens or kv is not None:
            if params.n != 1:
                raise ValueError("resume_tokens: only for n=1")
            produced[0] = list(resume_tokens)
            stream = self._inner.generate(request_id, prompt_token_ids, params, resume_tokens=list(resume_tokens),
                                          lora=lora, session=session, tenant=tenant, kv=kv)
        else:
            stream = self._inner.generate(request_id, prompt_token_ids, params, lora=lora, session=session,
                                          tenant=tenant)
        while True:
            try:
                async with aclosing(stream) as outputs:
                    async for out in outputs:
                        moved = out.engine_failed and out.moved_from is not None and moves < MAX_MOVES
                        lost = moved or (out.engine_failed and failovers < self._max_failovers)
                        if lost:             # its tokens are real; its "error" finish is the replica's
                            handed_kv = out.kv            # a removed or moving replica's blocks (per sample: n > 1)
                            moved_from = out.moved_from if moved else None
                            out = replace(out, outputs=[replace(c, finish_reason=None) for c in out.outputs
                                                        if c.token_ids], error=None, finished=False,
                                          engine_failed=False, kv=None, moved_from=None)
                        if failovers or moves:   # the prompt was reported once, by the first replica
                            out = replace(out, prompt_token_ids=None, prompt_logprobs=None,
                                          num_cached_prompt_tokens=cached)
                        cached = out.num_cached_prompt_tokens
                        for completion in out.outputs:
                            produced[completion.index] += completion.token_ids
                            done[completion.index] |= completion.finish_reason is not None
                        if failovers or moves:   # each continuation finishes its own sample only
                            out = replace(out, finished=all(done))
                        if out.outputs or out.finished or out.error is not None:
                            yield out
                        if lost:
                            raise ReplicaLost("the engine failed under the request")
                return
            except (*REPLICA_LOST, ReplicaLost) as exc:
                if moved_from is None:
                    if failovers >= self._max_failovers or all(done) or isinstance(exc, NotPlaced):
                        raise
                    if await self._app_deleting():
                        raise NotPlaced("engine dead: the app is being deleted (the server is stopping); "
                                        "no engine replica will take the request's continuation") from exc
            if moved_from is not None:   # a planned move: at once, to another replica, not a failover
                moves += 1
                self._on_move()
                name = f"{request_id}:moved{moves}"
            else:
                failovers += 1
                self._on_failover()
                await self._sleep(BACKOFF_S[min(failovers, len(BACKOFF_S)) - 1])
                name = f"{request_id}:failover{failovers}"
            stream = self._continuation(name, prompt_token_ids, params, produced, done, lora, session, tenant,
                                        handed_kv, moved_from)
            handed_kv, moved_from = None, None

    def _continuation(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      produced: list[list[int]], done: list[bool], lora=None, session=None, tenant=None, kv=None,
                      exclude: str | None = None) -> AsyncIterator[RequestOutput]:
        """One stream of the unfinished samples' continuations, under their own indices; each of them must
        be placed within the placement timeout. ``kv``: the blocks the lost replica handed over (n > 1: a tuple,
        one per sample); ``exclude``: the replica a moved request left (the router places it elsewhere)."""
        def placed(rid: str, sample_params: SamplingParams, tokens: list[int], kv=None) -> AsyncIterator[RequestOutput]:
            resume = list(tokens)        # a snapshot: ``produced`` keeps growing as the continuation streams
            extra = {} if kv is None else {"kv": kv}
            if exclude is not None:
                extra["exclude"] = exclude
            return _placed_within(lambda: self._inner.generate(rid, prompt_token_ids, sample_params,
                                                               resume_tokens=resume, lora=lora, session=session,
                                                               tenant=tenant, **extra),
                                  self._placement_timeout_s, self._sleep)

        if params.n == 1:
            return placed(request_id, params, produced[0], kv)
        streams, indices = [], []
        for i in range(params.n):
            if not done[i]:
                seed = None if params.seed is None else sibling_seed(params.seed, i)
                sample_kv = kv[i] if isinstance(kv, tuple) and i < len(kv) else None
                streams.append(placed(f"{request_id}:{i}", replace(params, n=1, seed=seed), produced[i], sample_kv))
                indices.append(i)
        return _merged(streams, indices)

    # the rest is the inner client's
    async def stats(self):
        return await self._inner.stats()

    async def replica_states(self) -> list:
        return await self._inner.replica_states()

    async def check_ready(self) -> None:
        await self._inner.check_ready()

    async def check_lora(self, lora) -> None:
        await self._inner.check_lora(lora)


async def _merged(streams: list[AsyncIterator[RequestOutput]], indices: list[int]) -> AsyncIterator[RequestOutput]:
    """Per-sample continuation streams as one: each output's sample 0 renamed to its original index."""
    async for which, out in merge_streams(streams):
        yield replace(out, outputs=[CompletionOutput(indices[which], c.token_ids, c.logprobs, c.finish_reason)
                                    for c in out.outputs])


async def _placed_within(make_stream: Callable[[], AsyncIterator[RequestOutput]], timeout_s: float,
                         sleep: Callable[[float], object]) -> AsyncIterator[RequestOutput]:
    """The stream ``make_stream()`` starts, whose first output must come within ``timeout_s`` (NotPlaced
    otherwise: the request cannot be placed, and ends). A refusal before that first output (a full
    admission queue, a draining replica) starts it again after ``REFUSED_RETRY_S``, within the same time."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        async with aclosing(make_stream()) as outputs:
            iterator = aiter(outputs)
            try:
                first = await asyncio.wait_for(anext(iterator), max(0.0, deadline - loop.time()))
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise NotPlaced(f"engine dead: no engine replica took the request's continuation within "
                                f"{timeout_s:.0f} s") from None
            except (QueueFullError, EngineDrainingError) as exc:
                if loop.time() + REFUSED_RETRY_S >= deadline:
                    raise NotPlaced(f"engine dead: every engine replica refused the request's continuation for "
                                    f"{timeout_s:.0f} s ({engine_error_message(exc)})") from None
            else:
                yield first
                async for out in iterator:
                    yield out
                return
        await sleep(REFUSED_RETRY_S)
