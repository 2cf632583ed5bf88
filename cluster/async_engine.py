"""AsyncEngine: the central actor's body: async streams over the synchronous Engine.

Threads: the asyncio event loop (intake, streams, health) and ONE step thread that alone touches
the Engine. Intake (``generate``, ``abort``) only validates the arguments (no engine state), appends
a command to a deque under a lock held for that append, and wakes the step loop: it never waits for
a step. The step thread drains the commands, applies them, runs one ``Engine.step`` and hands the
outputs back to the loop, which puts them on the per-request asyncio queues.

The step loop is an asyncio task: it sleeps on an Event while there is no work. When requests wake an
idle engine, it first lets the burst they may belong to arrive (``idle_batch_wait_ms``, below); while
there is work, the
step thread runs steps back to back by itself (``_step_burst``) and posts each step's outputs to the
loop, so a busy event loop (HTTP, streaming) never holds up the next step. Reads of the engine's state
(``cached_prefix_hashes``, ``hot_prefixes``) travel the same command deque (``ReadCommand``): they run
between two steps, also in the middle of a burst.

Idle batch wait: clients often send several requests at once (a wave of a load test, a batch job,
n parallel tool calls), and they reach the engine spread over a few milliseconds (HTTP, the Serve
proxy, tokenization). An idle engine that stepped on the first arrival would prefill it alone while the
others queue behind that step; every later arrival's first token then waits for it, and the
requests' decodes stay out of step for their whole lives (measured: a 16-request wave on the 2-core
VM arrived over 5 ms, and the first request's lone 21-87 ms prefill step delayed the other 15). So
an idle engine that receives a request waits until ``idle_batch_wait_ms`` pass with no further
arrival, at most 8x that in all, then steps. An engine whose last requests finished in the step that
just ran is idle too: the requests that arrived during that step wait for the rest of their burst
(a closed-loop client sends its next wave as the last one ends; measured on the 2-core VM: 1-2 of a
16-request wave were prefilled alone and the other 14 waited ~150 ms for that step). When the first
arrival comes within the wait's cap of the step that emptied the engine, it is taken for the replacement
of a request that step finished (closed-loop clients, agents, batch jobs send the next request as one
ends): the engine then waits for as many arrivals as that step finished requests, a quiet window not
ending the wait before that, at most 16 windows in all (a 16-request wave reached the engine over up to
30 ms on the 2-core VM, with gaps of 4-8 ms). An engine that still runs requests never waits: new
arrivals join its next step.

Decisions: docs/design/cluster.md, ``pagedray.cluster.async_engine``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Container
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from pagedray.workers.contract.config import EngineConfig
from pagedray.workers.contract.lora_request import LoRARequest
from pagedray.workers.contract.sampling_params import SamplingParams

from .engine import Engine
from .executor import Executor
from .kv_transfers import KVExport, Transfer, movable_requests
from .outputs import (
    CompletionOutput,
    EngineDeadError,
    EngineDrainingError,
    QueueFullError,
    RequestOutput,
    merge_deltas,
)
from .stats import EngineStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AddCommand:
    """Event loop -> step thread: admit a request (applied before the next step)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    resume_tokens: list[int]
    lora: LoRARequest | None = None
    session: str | None = None
    tenant: str | None = None


@dataclass(frozen=True)
class AbortCommand:
    """Event loop -> step thread: abort a request (its blocks are freed before the next step)."""

    request_id: str


@dataclass
class ReadCommand:
    """Event loop -> step thread: call ``read`` between two steps (it reads the engine's state) and settle
    ``future`` with its result on the event loop."""

    read: Callable[[], object]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop

    def read_and_settle(self) -> None:
        try:
            result = self.read()
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            self.loop.call_soon_threadsafe(_settle, self.future, None, exc)
        else:
            self.loop.call_soon_threadsafe(_settle, self.future, result, None)


def _settle(future: asyncio.Future, result, exc: BaseException | None) -> None:
    if future.done():           # the caller went away
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


STALL_GRACE_FACTOR = 2.0     # the watchdog ends the streams after this many step limits
WATCHDOG_POLL_S = 0.05
IDLE_BATCH_WAITS = 8           # the idle batch wait: at most this many quiet windows
REPLACEMENT_WAITS = 16         # ... or this many while the replacements of just-finished requests arrive


class AsyncEngine:
    def __init__(self, config: EngineConfig, executor: Executor | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.engine = Engine(config, executor)
        self.config = self.engine.config      # as the engine settled it (a hybrid model: cluster/hybrid.py)
        self._clock = clock   # step ages, the watchdog and drain deadlines (tests pass a fake clock)
        self._sleep = sleep   # the idle batch wait's pauses (tests pass one they release by hand)
        self._lock = threading.Lock()             # guards _commands and _pending_adds only
        self._commands: collections.deque = collections.deque()
        self._pending_adds = 0
        self._first_add_at = 0.0   # when the first add not yet applied arrived
        self._emptied: tuple[float, int] = (float("-inf"), 0)   # (when, requests finished) of the step that emptied
        self._streams: dict[str, asyncio.Queue] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedray-step")
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None     # set while the step loop waits for work
        self._loop_task: asyncio.Task | None = None
        self._step_started: float | None = None
        self._stats = self.engine.stats()
        self._draining = False
        self._closed = False
        self._stalled: EngineDeadError | None = None
        self._num_samples: dict[str, int] = {}   # request_id -> params.n (for the watchdog's error outputs)

    # -- intake -------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, resume_tokens: list[int] = (), lora: LoRARequest | None = None,
                       session: str | None = None, tenant: str | None = None) -> AsyncIterator[RequestOutput]:
        """The request's output deltas (``resume_tokens``, ``lora``, ``session``, ``tenant``: ``Engine.add``)."""
        self._check_accepting()
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        self.engine.validate(prompt_token_ids, params, priority, resume_tokens, lora, session, tenant)
        limit = self.config.scheduler.max_queued_requests
        with self._lock:
            if self._stats.num_waiting + self._pending_adds >= limit:
                raise QueueFullError(f"{limit} requests are waiting (max_queued_requests); retry later")
            if self._pending_adds == 0:
                self._first_add_at = self._clock()
            self._pending_adds += 1
            self._commands.append(AddCommand(request_id, list(prompt_token_ids), params, priority,
                                             list(resume_tokens), lora, session, tenant))
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        self._num_samples[request_id] = params.n
        self._ensure_loop()
        finished, sent_first = False, False
        held: RequestOutput | None = None   # step outputs not sent yet (stream_interval > 1)
        num_held = 0
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                held = item if held is None else merge_deltas(held, item)
                num_held += 1
                if finished or not sent_first or num_held >= self.config.stream_interval:
                    out, held, num_held, sent_first = held, None, 0, True
                    yield out
        finally:
            self._num_samples.pop(request_id, None)
            if not finished:
                self._streams.pop(request_id, None)
                self._push(AbortCommand(request_id))

    async def abort(self, request_id: str) -> bool:
        if request_id not in self._streams:
            return False
        self._push(AbortCommand(request_id))
        return True

    async def _between_steps(self, read: Callable[[], object]):
        """``read()`` on the step thread between two steps, also while steps run back to back under load."""
        if self._closed:
            raise EngineDeadError("the engine has been shut down")
        self._raise_if_loop_failed()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._push(ReadCommand(read, future, loop))
        self._ensure_loop()
        return await future

    def _push(self, command: AbortCommand | ReadCommand) -> None:
        with self._lock:
            self._commands.append(command)
        if self._wake is not None and not self._closed:
            self._wake.set()

    def _check_accepting(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine has been shut down")
        if self._draining:
            raise EngineDrainingError("the engine is draining and accepts no new requests")
        if self._stalled is not None:
            raise self._stalled
        self._raise_if_loop_failed()

    # -- step loop ----------------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._loop_task is None:
            self._wake = asyncio.Event()
            self._idle = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())
        self._wake.set()

    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                with self._lock:
                    if not self._commands:   # a burst that ended idle with arrivals queued goes round again
                        self._idle.set()
                await self._wake.wait()
                self._idle.clear()
                await self._let_burst_arrive()
                self._wake.clear()
                burst = loop.run_in_executor(self._pool, self._step_burst, loop)
                if not await self._watch(burst):
                    return
                burst.result()   # re-raises what crashed the step thread
        except Exception as exc:  # a crashed loop must not leave any consumer waiting
            logger.error("the step loop crashed", exc_info=exc)
            dead = EngineDeadError("engine dead: the step loop crashed (the server log has the details)")
            for queue in self._streams.values():
                queue.put_nowait(dead)
            self._streams.clear()
            raise

    async def _let_burst_arrive(self) -> None:
        """The idle batch wait (module doc), when requests are queued. The loop only gets here after a burst
        returned for lack of work (``_step_burst``), so no request is running or waiting in the engine."""
        window = self.config.idle_batch_wait_ms / 1e3
        if window <= 0 or self._pending_adds == 0:
            return
        emptied_at, finished = self._emptied
        replacing = self._first_add_at - emptied_at <= IDLE_BATCH_WAITS * window
        expected, waits = (finished, REPLACEMENT_WAITS) if replacing else (1, IDLE_BATCH_WAITS)
        seen = self._pending_adds
        for _ in range(waits):
            await self._sleep(window)
            if self._closed or (self._pending_adds == seen and seen >= expected):
                return
            seen = self._pending_adds

    async def _watch(self, step: asyncio.Future) -> bool:
        """Waits for a step; False when the watchdog declared it stalled (streams ended with "error")."""
        while not step.done():
            await asyncio.wait({step}, timeout=WATCHDOG_POLL_S)
            started = self._step_started
            if (not step.done() and started is not None and not self.engine.recovering
                    and self._clock() - started > STALL_GRACE_FACTOR * self.engine.step_limit_s):
                self._declare_stalled(self._clock() - started)
                return False
        return True

    def _declare_stalled(self, elapsed: float) -> None:
        message = (f"a step has not returned after {elapsed:.1f} s (its limit: {self.engine.step_limit_s:.1f} s "
                   f"from step_timeout_s={self.config.step_timeout_s} + step_timeout_per_token_s="
                   f"{self.config.step_timeout_per_token_s} per token); the engine is marked dead")
        self._stalled = EngineDeadError(message)
        self._pool.submit(self.engine.fail, self._stalled)   # runs once the stalled step returns
        for request_id, queue in self._streams.items():
            queue.put_nowait(self._failed_output(request_id, message))
        self._streams.clear()

    def _failed_output(self, request_id: str, message: str) -> RequestOutput:
        """The last output of a request that ends through no fault of its own (``engine_failed``: the
        ingress may continue it on another replica)."""
        n = self._num_samples.get(request_id, 1)
        return RequestOutput(request_id=request_id, finished=True, error=message, engine_failed=True,
                             outputs=[CompletionOutput(index=i, finish_reason="error") for i in range(n)])

    def _step_burst(self, loop: asyncio.AbstractEventLoop) -> None:
        """Runs on the step thread: steps back to back while requests are running or waiting, handing each
        step's outputs to the event loop as it goes (``call_soon_threadsafe`` keeps them in order), so that
        the next step never waits for the loop to take the last one's outputs. It returns once the engine
        holds no request, even when new ones arrived during the last step: they are the start of a burst,
        and the loop lets it arrive (the idle batch wait) rather than prefill the first ones alone."""
        while True:
            outputs, errors, busy = self._step_once()
            loop.call_soon_threadsafe(self._deliver, outputs, errors)
            if not busy or self._stalled is not None or self._closed:
                return

    def _step_once(self) -> tuple[list[RequestOutput], list[tuple[str, BaseException]], bool]:
        """Runs on the step thread: apply commands, run one step, snapshot stats."""
        with self._lock:
            commands = list(self._commands)
            self._commands.clear()
        errors = []
        for command in commands:
            if isinstance(command, AddCommand):
                with self._lock:
                    self._pending_adds -= 1
                try:
                    self.engine.add(command.request_id, command.prompt_token_ids, command.params,
                                    command.priority, command.resume_tokens, validated=True,   # at intake
                                    lora=command.lora, session=command.session, tenant=command.tenant)
                except (ValueError, QueueFullError, EngineDeadError) as exc:
                    errors.append((command.request_id, exc))
            elif isinstance(command, ReadCommand):
                command.read_and_settle()
            else:
                self.engine.abort(command.request_id)
        outputs = []
        if self.engine.has_unfinished_requests():
            self._step_started = self._clock()
            try:
                outputs = self.engine.step()
            finally:
                self._step_started = None
        self._stats = self.engine.stats()
        if outputs and not self.engine.has_requests():
            self._emptied = (self._clock(), sum(1 for out in outputs if out.finished))
        with self._lock:
            arrivals = self._pending_adds > 0
        # new arrivals at an engine with no request left: back to the loop's idle batch wait (the releases
        # of the finished sequences ride on the burst's first step)
        return outputs, errors, self.engine.has_requests() or (not arrivals and self.engine.has_unfinished_requests())

    def _deliver(self, outputs: list[RequestOutput], errors: list) -> None:
        for request_id, exc in errors:
            queue = self._streams.pop(request_id, None)
            if queue is not None:
                queue.put_nowait(exc)
        for out in outputs:
            queue = self._streams.get(out.request_id)
            if queue is None:
                continue   # the consumer went away; its abort is applied before the next step
            queue.put_nowait(out)
            if out.finished:
                del self._streams[out.request_id]

    # -- health / stats / drain ---------------------------------------------------------------
    def _raise_if_loop_failed(self) -> None:
        task = self._loop_task
        if task is not None and task.done():
            exc = None if task.cancelled() else task.exception()
            if exc is not None:
                logger.error("the step loop stopped", exc_info=exc)
            raise EngineDeadError("engine dead: the step loop stopped (the server log has the details)")

    async def check_alive(self) -> None:
        """Liveness (Serve's replica hook): ``check_health``, except that a TP group being rebuilt after a rank
        failure counts as alive. A rebuild loads the model again, which takes longer than Serve's three failed
        checks (~15 s) for any real model, or for a small one on a loaded machine: Serve would replace the
        replica and cut the streams the rebuild is about to resume. Every wait of a rebuild is bounded
        (placement, ``ray_executor.START_TIMEOUT_S``), and a rebuild that fails leaves the engine dead, which
        this then reports."""
        if self.engine.recovering:
            self._raise_if_down()
            return
        await self.check_health()

    def _raise_if_down(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine has been shut down")
        if self._stalled is not None:
            raise self._stalled
        self._raise_if_loop_failed()
        if self.engine.is_dead:
            self.engine.check_health()

    async def check_health(self) -> None:
        """Alive and serving: also raises while the TP group is being rebuilt (readiness, /health)."""
        self._raise_if_down()
        if self.engine.recovering:
            raise EngineDeadError("a TP rank failed; the TP group is being rebuilt (in-flight requests resume after)")
        started, limit = self._step_started, self.engine.step_limit_s
        if started is not None and self._clock() - started > limit:
            raise EngineDeadError(f"a step has been running for more than its limit of {limit:.1f} s "
                                  f"(step_timeout_s={self.config.step_timeout_s} + step_timeout_per_token_s="
                                  f"{self.config.step_timeout_per_token_s} per token)")
        await asyncio.to_thread(self.engine.executor.check_health)

    async def stats(self) -> EngineStats:
        return self._stats

    async def check_lora(self, lora: LoRARequest) -> None:
        """ValueError naming the problem unless this engine can serve ``lora`` (its files read anew, off the
        event loop: a run-time load, ``deploy/openai/lora_adapters.py``)."""
        registry = self.engine.lora_registry
        if registry is None:
            raise ValueError("lora_name: this engine serves no LoRA adapters (start it with enable_lora)")
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request: must be a LoRARequest, got {type(lora).__name__}")
        await asyncio.to_thread(registry.check, lora, True)

    def resident_adapters(self) -> list[str]:
        """The names of the LoRA adapters in the ranks' slots (a snapshot; empty without ``enable_lora``)."""
        slots = self.engine.scheduler.lora_slots
        return [] if slots is None else [name for name in list(slots.names) if name is not None]

    async def cached_prefix_hashes(self, limit: int) -> list[int]:
        """``BlockManager.cached_prefix_hashes`` read on the step thread (between steps, never during one)."""
        return await self._between_steps(lambda: self.engine.block_manager.cached_prefix_hashes(limit))

    async def tier_summary(self, limit: int) -> tuple[list[int], float]:
        """(``BlockManager.tier_key_hashes``, ``Engine.tier_cost.weight``), read on the step thread (between steps)."""
        return await self._between_steps(lambda: (self.engine.block_manager.tier_key_hashes(limit),
                                                  self.engine.tier_cost.weight))

    async def hot_prefixes(self, max_tokens: int) -> list[list[int]]:
        """``BlockManager.hot_prefixes`` read on the step thread (between steps)."""
        return await self._between_steps(lambda: self.engine.block_manager.hot_prefixes(max_tokens))

    async def export_prefix(self, token_ids: list[int], lora: LoRARequest | None = None) -> KVExport:
        """``Engine.start_export`` between two steps; the KVExport once the next steps read the blocks."""
        return await self._transfer(lambda: self.engine.start_export(token_ids, lora))

    async def export_request(self, request_id: str, sample: int = 0) -> KVExport | None:
        """``Engine.start_request_export`` between two steps: the blocks of a running request's sample, or None."""
        return await self._transfer(lambda: self.engine.start_request_export(request_id, sample))

    async def _handed_over_kv(self, request_id: str, pack: Callable[[KVExport], Awaitable[KVExport]]):
        """The blocks a handed-over request takes along: its KVExport (n=1), or one per sample (a tuple; None for a
        finished sample), each ``pack``ed; None for what could not be exported."""
        n = self._num_samples.get(request_id, 1)
        exports = await asyncio.gather(*(self._handed_over_sample(request_id, i, pack) for i in range(n)))
        return exports[0] if n == 1 else (None if all(e is None for e in exports) else tuple(exports))

    async def _handed_over_sample(self, request_id: str, sample: int, pack: Callable[[KVExport], Awaitable[KVExport]]):
        try:
            export = await self.export_request(request_id, sample)
            return None if export is None or export.num_blocks == 0 else await pack(export)
        except Exception as exc:  # noqa: BLE001 - without its blocks the continuation computes them
            logger.warning("request %s is handed over without its KV blocks (%s: %s)", request_id,
                           type(exc).__name__, exc)
            return None

    async def hand_over(self, count: int, source: str, pack: Callable[[KVExport], Awaitable[KVExport]],
                        keep: Container[str] = ()) -> list[str]:
        """Moves up to ``count`` n=1 requests away (rebalancing between live replicas: deploy/serve/rebalance.py):
        each one's blocks are exported and ``pack``ed, and its stream ends with an ``engine_failed`` output carrying
        them (``kv``) and ``moved_from=source``, which the ingress continues on another replica. Waiting requests go
        first (they lose nothing), then the running ones with the most tokens left to generate. ``keep``: request
        ids never moved (those moved here, so that a request is not bounced back). Returns the ids moved."""
        if count < 0:
            raise ValueError(f"count: must be >= 0, got {count}")
        if count == 0 or self._closed or self._stalled is not None:
            return []
        in_flight = set(self._streams) - set(keep)
        chosen = await self._between_steps(lambda: movable_requests(self.engine.scheduler, in_flight, count))
        kvs = await asyncio.gather(*(self._handed_over_kv(r, pack) for r in chosen))
        moved = []
        for request_id, kv in zip(chosen, kvs):
            queue = self._streams.pop(request_id, None)
            if queue is None:                  # it finished while its blocks were exported
                continue
            failed = self._failed_output(request_id, f"moved: the engine replica {source} handed the request over")
            queue.put_nowait(replace(failed, kv=kv, moved_from=source))
            self._push(AbortCommand(request_id))
            moved.append(request_id)
        return moved

    async def import_prefix(self, export: KVExport) -> int:
        """``Engine.start_import`` between two steps; the tokens of ``export`` cached here once they are written."""
        return await self._transfer(lambda: self.engine.start_import(export))

    async def _transfer(self, start: Callable[[], Transfer]):
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def begin() -> None:
            start().on_done(lambda t: loop.call_soon_threadsafe(_settle, done, t.result, t.error))
        await self._between_steps(begin)
        return await done

    @property
    def model_path(self) -> str:
        return str(self.engine.model_path)

    @property
    def dtype(self) -> str:
        """The dtype the ranks run ("float32", "bfloat16", ...): ``dtype`` "auto" resolved."""
        return self.engine.dtype

    @property
    def vocab_size(self) -> int:
        return int(self.engine.model_info.vocab_size)

    @property
    def max_model_len(self) -> int:
        """The effective context length (the config's, clamped to the model's)."""
        return int(self.engine.max_model_len)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def drain(self, timeout_s: float, hand_over: bool = False,
                    pack: Callable[[KVExport], Awaitable[KVExport]] | None = None) -> int:
        """Refuse new requests, wait up to ``timeout_s`` for the in-flight ones, abort the rest; returns
        how many were aborted. ``hand_over``: the rest end with an ``engine_failed`` output instead of
        finish_reason "abort", so that the ingress continues them on another replica (a replica that
        Serve removes: deploy/serve/failover.py); with ``pack`` each request's blocks are exported first (per sample
        when n > 1) and that output carries them (``RequestOutput.kv``, ``pack``ed: put in the object store), so
        that its continuations import them instead of computing the prompt and outputs again."""
        self._draining = True
        deadline = self._clock() + timeout_s
        while self._streams and self._clock() < deadline:
            await asyncio.sleep(0.05)
        unfinished = list(self._streams)
        kvs: dict[str, KVExport | None] = {}
        if hand_over and pack is not None and not self._closed and self._stalled is None:
            kvs = dict(zip(unfinished, await asyncio.gather(*(self._handed_over_kv(r, pack) for r in unfinished))))
        for request_id in unfinished:
            if hand_over:
                queue = self._streams.pop(request_id, None)
                if queue is not None:         # not finished while its blocks were exported
                    failed = self._failed_output(request_id, "engine dead: the engine replica was shut down")
                    queue.put_nowait(replace(failed, kv=kvs.get(request_id)))
                self._push(AbortCommand(request_id))
            else:
                await self.abort(request_id)
        while self._streams and self._loop_task is not None and not self._loop_task.done():
            await asyncio.sleep(0.01)
        await self._wait_idle(max(0.0, deadline - self._clock()) + 5.0)
        return len(unfinished)

    async def _wait_idle(self, timeout_s: float) -> None:
        """Waits until the step loop has nothing left to do: the aborts of consumers that went away and
        the release of finished sequences from the worker mirrors are applied (bounded by timeout_s)."""
        task = self._loop_task
        if task is None or task.done():
            return
        with self._lock:
            pending = bool(self._commands)
        if pending:
            self._wake.set()
            self._idle.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=timeout_s)
        except asyncio.TimeoutError:
            pass

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._pool.shutdown(wait=self._stalled is None)   # a stalled step thread cannot be joined
        self.engine.shutdown()
