"""Stall watchdog of AsyncEngine over the SleepingFakeExecutor test double: a step that does not
return makes check_health fail after step_timeout_s, ends every in-flight stream (running and still
queued, n > 1 included) with finish_reason "error" after STALL_GRACE_FACTOR * step_timeout_s instead
of hanging, refuses new requests, and frees every block once the stalled step finally returns.
The engine runs on a FakeClock: the test moves time, so a loaded machine cannot change the outcome."""

import asyncio
import time

import pytest
from helpers.fake_executor import FakeClock, SleepingFakeExecutor
from pagedray.cluster.async_engine import STALL_GRACE_FACTOR, AsyncEngine
from pagedray.cluster.outputs import EngineDeadError
from pagedray.workers.contract.config import CacheConfig, EngineConfig, ModelConfig
from pagedray.workers.contract.sampling_params import SamplingParams

STEP_TIMEOUT_S = 0.5


async def _collect(engine, rid, prompt, max_tokens, n=1):
    outs = []
    async for out in engine.generate(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, n=n)):
        outs.append(out)
    return outs


def test_stalled_step_fails_health_then_ends_streams_with_error_and_frees_blocks(tiny_llama_path):
    fake, clock = SleepingFakeExecutor(64, sleep_at_step=2, max_sleep_s=120), FakeClock()
    config = EngineConfig(model=ModelConfig(model=tiny_llama_path), cache=CacheConfig(block_size=8, num_blocks=64),
                          step_timeout_s=STEP_TIMEOUT_S, step_timeout_per_token_s=0.0)
    engine = AsyncEngine(config, executor=fake, clock=clock)

    async def main():
        tasks = [asyncio.create_task(_collect(engine, "a", [3, 4, 5], 50)),
                 asyncio.create_task(_collect(engine, "b", list(range(20)), 50, n=2))]
        await asyncio.to_thread(fake.sleeping.wait, 60)
        queued = asyncio.create_task(_collect(engine, "c", [9], 5))     # added while the step is stalled
        await engine.check_health()                                    # just stalled: still healthy
        clock.advance(STEP_TIMEOUT_S + 0.1)
        with pytest.raises(EngineDeadError, match="step_timeout_s"):
            await engine.check_health()
        await asyncio.sleep(0.2)                                       # several watchdog polls ...
        assert not any(task.done() for task in (*tasks, queued))       # ... but the grace has not passed
        clock.advance(STEP_TIMEOUT_S * STALL_GRACE_FACTOR)
        results = await asyncio.wait_for(asyncio.gather(*tasks, queued), timeout=120)   # hang guard only
        with pytest.raises(EngineDeadError, match="not returned"):
            await _collect(engine, "d", [1], 1)
        return results
    try:
        results = asyncio.run(main())
        for outs, n in zip(results, (1, 2, 1)):
            last = outs[-1]
            assert last.finished and "step_timeout_s" in last.error
            assert sorted(c.index for c in last.outputs) == list(range(n))
            assert {c.finish_reason for c in last.outputs} == {"error"}
            assert not any(o.finished for o in outs[:-1])
        assert fake.mirror != {}                     # the stalled step still holds its sequences
        fake.wake.set()                              # the stalled step returns: Engine.fail frees everything
        bm = engine.engine.block_manager
        deadline = time.monotonic() + 120   # hang guard: the step thread runs Engine.fail
        while bm.num_free_blocks != bm.num_blocks and time.monotonic() < deadline:
            time.sleep(0.02)
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks and bm.sequence_ids() == []
        assert engine.engine.is_dead
    finally:
        fake.wake.set()
        engine.shutdown()
