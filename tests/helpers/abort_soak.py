"""Abort soak harness (used by test_abort_soak.py): many greedy requests through AsyncEngine +
LocalExecutor (tiny model, small KV pool so preemption is frequent, small token budget so prefills
are chunked), a fraction of them ended early at random moments by one of three means:

- "abort":  ``AsyncEngine.abort(request_id)``, then the stream is read to its final output;
- "cancel": the consuming task is cancelled (the generator's ``finally`` aborts the request);
- "aclose": the consumer stops iterating and closes the stream.

Each aborted request has a target moment: once it is seen (polled from the event loop) queued,
mid-prefill, mid-decode or preempted, or after a random delay. The state a request was in when its
abort was applied ("queued", "prefill", "decode", "preempted",
or "done" when it had already finished) is recorded by wrapping ``Engine.abort`` on the step thread,
where the scheduler state is consistent.
"""

import asyncio
import collections
import random
from dataclasses import dataclass, field

from pagedray.cluster.async_engine import AsyncEngine
from pagedray.cluster.request import SequenceStatus
from pagedray.workers.contract.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedray.workers.contract.sampling_params import SamplingParams

METHODS = ("abort", "cancel", "aclose")
# an aborted request is ended once it is seen in this state (polled from the event loop; the state
# recorded is the one found when the abort is applied), or after a random delay ("any")
TARGETS = ("queued", "prefill", "decode", "preempted", "any")
STATE_WAIT_S = 5.0


@dataclass
class SoakResult:
    tokens: dict = field(default_factory=dict)            # request_id -> tokens received
    finish: dict = field(default_factory=dict)            # request_id -> finish reason (None: closed early)
    planned: dict = field(default_factory=dict)           # request_id -> method, for the aborted ones
    abort_states: collections.Counter = field(default_factory=collections.Counter)
    state_of: dict = field(default_factory=dict)          # request_id -> state when the abort applied


def make_workload(num: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(2, 512) for _ in range(rng.randint(3, 160))], rng.randint(2, 24)) for _ in range(num)]


def soak_config(path: str) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=path, dtype="float32"), cache=CacheConfig(block_size=8, num_blocks=48),
                        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=24))


def _state(request) -> str:
    seqs = [s for s in request.sequences if not s.is_finished]
    if not seqs:
        return "done"
    seq = seqs[0]
    if seq.status is SequenceStatus.WAITING:
        return "preempted" if seq.num_preemptions else "queued"
    return "prefill" if seq.num_computed_tokens < len(seq.prompt_token_ids) else "decode"


def _record_abort_states(engine: AsyncEngine, result: SoakResult) -> None:
    inner = engine.engine
    original = inner.abort

    def abort(request_id):
        request = inner.scheduler.requests.get(request_id)
        state = "done" if request is None else _state(request)
        if request_id in result.planned and request_id not in result.state_of:
            result.state_of[request_id] = state
            result.abort_states[state] += 1
        return original(request_id)
    inner.abort = abort


async def _consume(engine, rid, prompt, max_tokens, close_flag: asyncio.Event, result):
    """Reads the stream to its end; closes it after the next output once ``close_flag`` is set."""
    tokens = result.tokens.setdefault(rid, [])
    gen = engine.generate(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    async for out in gen:
        tokens += out.outputs[0].token_ids if out.outputs else []
        if out.finished:
            result.finish[rid] = out.outputs[0].finish_reason
            return
        if close_flag.is_set():
            await gen.aclose()
            return


async def _reach(engine: AsyncEngine, rid: str, task: asyncio.Task, target: str, delay: float) -> None:
    """Returns once the request is seen in ``target`` (or after ``delay`` for "any"), or its task ended."""
    if target == "any":
        await asyncio.wait({task}, timeout=delay)
        return
    requests = engine.engine.scheduler.requests
    deadline = asyncio.get_running_loop().time() + STATE_WAIT_S
    while not task.done() and asyncio.get_running_loop().time() < deadline:
        request = requests.get(rid)
        if request is not None and _state(request) == target:
            return
        await asyncio.wait({task}, timeout=0.001)


async def run_soak(engine: AsyncEngine, workload, abort_fraction: float, seed: int, concurrency: int = 48,
                   mean_delay_s: float = 0.3):
    """Each aborted request is ended at its target moment (a state, or ``delay`` seconds after it was
    submitted: exponential, mean ``mean_delay_s``); returns a SoakResult after drain."""
    rng = random.Random(seed)
    result = SoakResult()
    _record_abort_states(engine, result)
    slots = asyncio.Semaphore(concurrency)
    plans = {}
    for i in range(len(workload)):
        if rng.random() < abort_fraction:
            plans[str(i)] = (rng.choice(METHODS), rng.choice(TARGETS), rng.expovariate(1 / mean_delay_s))
            result.planned[str(i)] = plans[str(i)][0]

    async def one(i, prompt, max_tokens):
        rid = str(i)
        async with slots:
            close_flag = asyncio.Event()
            task = asyncio.create_task(_consume(engine, rid, prompt, max_tokens, close_flag, result))
            plan = plans.get(rid)
            if plan is not None:
                await _reach(engine, rid, task, plan[1], plan[2])
                if not task.done():
                    if plan[0] == "abort":
                        await engine.abort(rid)
                    elif plan[0] == "cancel":
                        task.cancel()
                    else:
                        close_flag.set()
            try:
                await task
            except asyncio.CancelledError:
                pass
    await asyncio.gather(*(one(i, p, m) for i, (p, m) in enumerate(workload)))
    await engine.drain(timeout_s=60)
    return result
