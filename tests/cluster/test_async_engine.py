"""AsyncEngine over the FakeExecutor test doubles: streams, intake while a step runs, cancellation,
failure, stall detection, drain."""

import asyncio

import pytest
from fake_executor import FakeExecutor, GatedFakeExecutor
from pagedray.cluster.async_engine import AsyncEngine
from pagedray.cluster.config import CacheConfig, EngineConfig, ModelConfig
from pagedray.cluster.outputs import EngineDeadError, EngineDrainingError
from pagedray.cluster.sampling_params import SamplingParams


def _engine(path, executor, step_timeout_s=60.0):
    config = EngineConfig(model=ModelConfig(model=path), cache=CacheConfig(block_size=8, num_blocks=64),
                          step_timeout_s=step_timeout_s)
    return AsyncEngine(config, executor=executor)


async def _consume(engine, rid, prompt, max_tokens):
    tokens, outs = [], []
    async for out in engine.generate(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0)):
        outs.append(out)
        tokens += [t for c in out.outputs for t in c.token_ids]
    return tokens, outs


def test_concurrent_streams_get_their_own_tokens(tiny_llama_path):
    engine = _engine(tiny_llama_path, FakeExecutor(64))

    async def main():
        return await asyncio.gather(_consume(engine, "a", [10, 11], 4), _consume(engine, "b", [40], 6))
    try:
        (ta, oa), (tb, ob) = asyncio.run(main())
    finally:
        engine.shutdown()
    assert ta == [12, 13, 14, 15] and tb == [41, 42, 43, 44, 45, 46]
    assert oa[-1].finished and not any(o.finished for o in oa[:-1])
    assert ob[-1].outputs[0].finish_reason == "length"


def test_intake_abort_and_stats_do_not_wait_for_a_running_step(tiny_llama_path):
    fake = GatedFakeExecutor(64)
    engine = _engine(tiny_llama_path, fake)

    async def main():
        first = asyncio.create_task(_consume(engine, "a", [10, 11], 3))
        await asyncio.to_thread(fake.entered.wait, 10)       # step 0 is now blocked inside execute
        second = engine.generate("b", [20], SamplingParams(max_tokens=2, temperature=0))
        pending = asyncio.create_task(second.__anext__())
        await asyncio.sleep(0)                                # the add is queued while the step blocks
        assert await asyncio.wait_for(engine.abort("b"), timeout=5) is True
        # the snapshot of the last finished step: step 0 is still blocked, so none has finished
        assert (await asyncio.wait_for(engine.stats(), timeout=5)).num_steps_total == 0
        fake.gate.set()
        out_b = await asyncio.wait_for(pending, timeout=10)
        return await first, out_b
    try:
        (tokens_a, _), out_b = asyncio.run(main())
    finally:
        engine.shutdown()
    assert tokens_a == [12, 13, 14]
    assert out_b.finished and out_b.outputs[0].finish_reason == "abort"


def test_consumer_that_stops_iterating_aborts_and_frees_blocks(tiny_llama_path):
    engine = _engine(tiny_llama_path, FakeExecutor(64))

    async def main():
        gen = engine.generate("a", list(range(20)), SamplingParams(max_tokens=100, temperature=0))
        await gen.__anext__()
        await gen.aclose()
        for _ in range(100):
            if not engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
    try:
        asyncio.run(main())
        bm = engine.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks and bm.sequence_ids() == []
        assert engine.engine.executor.mirror == {} and engine.num_in_flight == 0
    finally:
        engine.shutdown()


def test_failing_step_ends_streams_with_error_and_reports_dead(tiny_llama_path):
    engine = _engine(tiny_llama_path, FakeExecutor(64, fail_at_step=1))

    async def main():
        results = await asyncio.gather(_consume(engine, "a", [3], 10), _consume(engine, "b", [5], 10))
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await _consume(engine, "c", [7], 2)
        return results
    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    for _, outs in results:
        assert outs[-1].finished and outs[-1].outputs[-1].finish_reason == "error"
        assert "simulated rank failure" in outs[-1].error


def test_slow_step_fails_health_check_until_it_returns(tiny_llama_path):
    # a step slower than step_timeout_s but back before the watchdog's grace (2 x) ends nothing
    fake = GatedFakeExecutor(64)
    engine = _engine(tiny_llama_path, fake, step_timeout_s=1.0)

    async def main():
        task = asyncio.create_task(_consume(engine, "a", [3], 2))
        await asyncio.to_thread(fake.entered.wait, 10)
        await engine.check_health()                      # just started: healthy
        await asyncio.sleep(1.2)
        with pytest.raises(EngineDeadError, match="step_timeout_s"):
            await engine.check_health()
        fake.gate.set()
        tokens, _ = await task
        await engine.check_health()                      # the step came back: healthy again
        return tokens
    try:
        assert asyncio.run(main()) == [4, 5]
    finally:
        engine.shutdown()


def test_drain_refuses_new_requests_and_finishes_in_flight(tiny_llama_path):
    engine = _engine(tiny_llama_path, FakeExecutor(64))

    async def main():
        task = asyncio.create_task(_consume(engine, "a", [3], 5))
        await asyncio.sleep(0)
        drain = asyncio.create_task(engine.drain(timeout_s=30))
        await asyncio.sleep(0)
        with pytest.raises(EngineDrainingError):
            await _consume(engine, "b", [4], 1)
        await drain
        assert engine.num_in_flight == 0
        return await task
    try:
        tokens, outs = asyncio.run(main())
    finally:
        engine.shutdown()
    assert tokens == [4, 5, 6, 7, 8] and outs[-1].outputs[0].finish_reason == "length"
