"""Async scheduling (``async_scheduling``): the engine schedules and submits step N+1 before it
waits for step N. Over the FakeExecutor double (tokens known exactly: (last + 1) % 512) every scenario
must stream exactly what the synchronous engine streams, leave no block or mirror behind, and really
schedule ahead (plans carry PENDING_TOKEN, one step stays queued). The real models are checked against
transformers in test_llm_local.py (both modes) and over Ray in test_ray_executor.py."""

from __future__ import annotations

import asyncio

import pytest
from helpers.fake_executor import FakeExecutor, RecoverableFakeExecutor
from pagedray.cluster.async_engine import AsyncEngine
from pagedray.cluster.engine import Engine
from pagedray.workers.contract.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagedray.workers.contract.sampling_params import SamplingParams
from pagedray.workers.contract.wire import PENDING_TOKEN


def _config(path, async_scheduling, num_blocks=64, budget=32, caching=True, max_rank_restarts=0):
    return EngineConfig(model=ModelConfig(model=path, dtype="float32"),
                        cache=CacheConfig(block_size=8, num_blocks=num_blocks, watermark=0.0,
                                          enable_prefix_caching=caching),
                        parallel=ParallelConfig(max_rank_restarts=max_rank_restarts),
                        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=6,
                                                  async_scheduling=async_scheduling))


def _run(engine, requests, abort_at=None):
    """Adds ``requests`` (id, prompt, params) and steps to the end; returns each request's outputs
    as (token ids per choice index, finish reasons) and the number of steps."""
    for request_id, prompt, params in requests:
        engine.add(request_id, prompt, params)
    streams, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 500, "the engine did not finish"
        if abort_at is not None and steps == abort_at[1]:
            assert engine.abort(abort_at[0])
        for out in engine.step():
            stream = streams.setdefault(out.request_id, {"tokens": {}, "finish": {}})
            for choice in out.outputs:
                stream["tokens"].setdefault(choice.index, []).extend(choice.token_ids)
                if choice.finish_reason is not None:
                    stream["finish"][choice.index] = choice.finish_reason
    return streams, steps


def _requests():
    shared = list(range(200, 224))                      # 3 full blocks shared by two prompts
    return [
        ("a", [10, 11, 12], SamplingParams(max_tokens=7, temperature=0)),
        ("b", list(range(100, 141)), SamplingParams(max_tokens=4, temperature=0)),    # chunked prefill
        ("c", [50, 51], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=(56,))),   # stops at 56
        ("d", [60, 61, 62, 63], SamplingParams(n=3, max_tokens=5, temperature=0)),   # forks
        ("e", shared + [5, 6], SamplingParams(max_tokens=6, temperature=0)),
        ("f", shared + [7], SamplingParams(max_tokens=9, temperature=0, min_tokens=3,
                                           stop_token_ids=(226,))),
        ("g", [300, 301, 302], SamplingParams(max_tokens=1, temperature=0)),       # a single token
    ]


def _both(path, requests, **config):
    results = {}
    for async_scheduling in (False, True):
        executor = FakeExecutor(config.get("num_blocks", 64))
        engine = Engine(_config(path, async_scheduling, **config), executor=executor)
        results[async_scheduling] = _run(engine, requests)[0], engine, executor
    return results


@pytest.mark.parametrize("config", [{}, {"num_blocks": 9}, {"budget": 8}, {"caching": False}],
                         ids=["plenty", "preempting", "small-budget", "no-prefix-cache"])
def test_async_scheduling_streams_what_the_synchronous_engine_streams(tiny_llama_path, config):
    results = _both(tiny_llama_path, _requests(), **config)
    (sync, _, _), (ahead, engine, executor) = results[False], results[True]
    assert ahead == sync
    assert sync["c"]["tokens"][0][-1] == 56 and sync["c"]["finish"] == {0: "stop"}
    assert sync["d"]["tokens"] == {i: [64, 65, 66, 67, 68] for i in range(3)}
    pending = sum(token == PENDING_TOKEN for plan in executor.plans for token in plan.decodes.token_ids)
    assert pending > 0                                   # it did schedule ahead
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and executor.mirror == {}
    assert engine.plan_builder.num_mirrored == 0
    if config.get("num_blocks"):
        assert engine.stats().num_preemptions_total > 0
    if config == {}:
        assert engine.stats().prefix_hit_tokens_total >= 24


def test_one_step_is_queued_ahead_and_the_last_step_drains_it(tiny_llama_path):
    executor = FakeExecutor(64)
    engine = Engine(_config(tiny_llama_path, True), executor=executor)
    engine.add("a", [10, 11, 12], SamplingParams(max_tokens=3, temperature=0))
    assert engine.step() == []                            # step 0 submitted, nothing applied yet
    assert len(executor.plans) == 1 and executor.waited == 0 and engine.has_unfinished_requests()
    outputs = engine.step()                               # step 1 submitted, step 0 applied
    assert len(executor.plans) == 2 and executor.waited == 1
    assert [t for o in outputs for c in o.outputs for t in c.token_ids] == [13]
    assert executor.plans[1].decodes.seq_ids == [0] and executor.plans[1].decodes.token_ids == [PENDING_TOKEN]
    streams, _ = _run(engine, [])
    assert streams["a"]["tokens"][0] == [14, 15] and streams["a"]["finish"] == {0: "length"}
    # max_tokens is known ahead: no step is spent past the third token; then a plan releases the mirror
    assert [plan.num_scheduled_tokens for plan in executor.plans] == [3, 1, 1, 0]
    assert executor.waited == len(executor.plans) and executor.plans[-1].released_seq_ids == [0]


def test_an_abort_while_its_step_is_queued_frees_everything(tiny_llama_path):
    requests = [("a", [10, 11, 12], SamplingParams(max_tokens=20, temperature=0)),
                ("b", [40, 41], SamplingParams(max_tokens=6, temperature=0))]
    executor = FakeExecutor(64)
    engine = Engine(_config(tiny_llama_path, True), executor=executor)
    streams, _ = _run(engine, requests, abort_at=("a", 4))
    assert streams["a"]["finish"] == {0: "abort"} and len(streams["a"]["tokens"][0]) < 20
    assert streams["b"]["tokens"][0] == [42, 43, 44, 45, 46, 47]
    assert engine.block_manager.num_free_blocks == 64 and executor.mirror == {}


def test_a_failed_step_ends_the_requests_and_the_queued_step_is_waited_for(tiny_llama_path):
    executor = FakeExecutor(64, fail_at_step=3)
    engine = Engine(_config(tiny_llama_path, True), executor=executor)
    streams, _ = _run(engine, [("a", [10, 11, 12], SamplingParams(max_tokens=20, temperature=0))])
    assert streams["a"]["finish"] == {0: "error"}
    assert engine.is_dead and executor.waited == len(executor.plans)
    assert engine.block_manager.num_free_blocks == 64


def test_recovery_from_a_rank_failure_finishes_as_an_undisturbed_run(tiny_llama_path):
    undisturbed = _both(tiny_llama_path, _requests())[False][0]
    executor = RecoverableFakeExecutor(64, fail_at_steps=(5,))
    engine = Engine(_config(tiny_llama_path, True, max_rank_restarts=1), executor=executor)
    streams, _ = _run(engine, _requests())
    assert executor.num_rebuilds == 1 and streams == undisturbed
    assert engine.block_manager.num_free_blocks == 64


def test_async_engine_streams_match_with_async_scheduling(tiny_llama_path):
    async def stream_all(async_scheduling):
        engine = AsyncEngine(_config(tiny_llama_path, async_scheduling), executor=FakeExecutor(64))

        async def consume(request_id, prompt, params):
            return [t async for out in engine.generate(request_id, prompt, params)
                    for c in out.outputs for t in c.token_ids]
        try:
            return await asyncio.gather(*(consume(*r) for r in _requests() if r[2].n == 1))
        finally:
            engine.shutdown()

    assert asyncio.run(stream_all(True)) == asyncio.run(stream_all(False))


def test_async_scheduling_needs_one_tp_rank(tiny_llama_path):
    with pytest.raises(ValueError, match="async_scheduling: needs tensor_parallel_size 1"):
        EngineConfig(model=ModelConfig(model=tiny_llama_path), parallel=ParallelConfig(tensor_parallel_size=2),
                     scheduler=SchedulerConfig(async_scheduling=True))
    with pytest.raises(ValueError, match="async_scheduling: must be true or false"):
        SchedulerConfig(async_scheduling="yes").validate()


class SubmitFailsFakeExecutor(FakeExecutor):
    """TEST DOUBLE: the submit of step ``fail_at`` raises (e.g. a rank that died between steps)."""

    def __init__(self, num_blocks, fail_at):
        super().__init__(num_blocks)
        self.fail_at = fail_at
        self.submitted = 0

    def submit(self, plan):
        if len(self.plans) == self.fail_at:
            raise RuntimeError("simulated failure while sending a plan")
        self.submitted += 1
        return super().submit(plan)


def test_a_failed_submit_still_settles_the_step_in_flight(tiny_llama_path):
    executor = SubmitFailsFakeExecutor(64, fail_at=3)
    engine = Engine(_config(tiny_llama_path, True), executor=executor)
    streams, _ = _run(engine, [("a", [10, 11, 12], SamplingParams(max_tokens=20, temperature=0))])
    assert streams["a"]["finish"] == {0: "error"} and engine.is_dead
    assert executor.submitted == 3 and executor.waited == 3      # the step before the failure was waited for
    assert engine.block_manager.num_free_blocks == 64
