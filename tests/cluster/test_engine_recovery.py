"""Engine rank-failure recovery over the RecoverableFakeExecutor test double (no Ray, no model): a
curable failure re-queues the running sequences (recompute), rebuilds the executor and every request
still finishes with the tokens of an undisturbed run; the limit (max_rank_restarts), a failed rebuild
and an incurable error end the requests with "error" and leave no block held."""

import pytest
from helpers.fake_executor import FakeExecutor, RecoverableFakeExecutor
from pagedray.cluster.engine import ENGINE_DEAD_MESSAGE, Engine
from pagedray.cluster.outputs import EngineDeadError
from pagedray.workers.contract.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagedray.workers.contract.sampling_params import SamplingParams

PROMPTS = {"a": [10, 11, 12, 13, 14, 15, 16, 17, 18, 19], "b": [40, 41], "c": list(range(100, 130))}


def _engine(path, executor, max_rank_restarts=3, num_speculative_tokens=0):
    config = EngineConfig(model=ModelConfig(model=path), cache=CacheConfig(block_size=8, num_blocks=32),
                          parallel=ParallelConfig(max_rank_restarts=max_rank_restarts),
                          scheduler=SchedulerConfig(num_speculative_tokens=num_speculative_tokens))
    return Engine(config, executor=executor)


class CountingProposer:
    """Proposes what the fake model samples (each token + 1), with every third draft wrong."""

    def propose_batch(self, requests):
        return [[(tokens[-1] + 1 + i) % 512 + (i == 2) for i in range(room)] for tokens, room in requests]


def _run(engine, max_tokens=12):
    for rid, prompt in PROMPTS.items():
        engine.add(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, n=2 if rid == "c" else 1))
    tokens, reasons, errors = {}, {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            errors += [out.error] if out.error else []
            for c in out.outputs:
                tokens.setdefault((out.request_id, c.index), []).extend(c.token_ids)
                if c.finish_reason:
                    reasons[(out.request_id, c.index)] = c.finish_reason
    return tokens, reasons, errors


def _assert_idle_and_clean(engine):
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and bm.sequence_ids() == []


@pytest.mark.parametrize("fail_at_steps", [(3,), (1, 6), (0,)])
def test_rank_failures_are_recovered_and_outputs_match_undisturbed_run(tiny_llama_path, fail_at_steps):
    expected, _, _ = _run(_engine(tiny_llama_path, FakeExecutor(32)))
    fake = RecoverableFakeExecutor(32, fail_at_steps=fail_at_steps)
    engine = _engine(tiny_llama_path, fake)
    tokens, reasons, errors = _run(engine)
    assert tokens == expected and errors == []
    assert set(reasons.values()) == {"length"} and len(reasons) == 4
    assert fake.num_rebuilds == len(fail_at_steps) == engine.stats().num_rank_restarts_total
    assert fake.mirror == {}
    _assert_idle_and_clean(engine)


@pytest.mark.parametrize("fail_at_steps", [(2,), (1, 4)])
def test_recovery_with_speculative_decoding_keeps_the_outputs(tiny_llama_path, fail_at_steps):
    """Drafts in flight when a rank fails: the re-queued sequences recompute and continue speculating,
    the outputs equal the undisturbed run's, no block or mirror is left."""
    expected, _, _ = _run(_engine(tiny_llama_path, FakeExecutor(32)))
    fake = RecoverableFakeExecutor(32, fail_at_steps=fail_at_steps)
    engine = _engine(tiny_llama_path, fake, num_speculative_tokens=3)
    engine.scheduler.proposer = CountingProposer()
    tokens, _, errors = _run(engine)
    stats = engine.stats()
    assert tokens == expected and errors == []
    assert fake.num_rebuilds == len(fail_at_steps)
    assert 0 < stats.spec_decode_num_accepted_tokens_total < stats.spec_decode_num_draft_tokens_total
    assert any(delta.accepted_token_ids for plan in fake.plans for delta in plan.running)
    assert fake.mirror == {}
    _assert_idle_and_clean(engine)


def test_restarts_beyond_the_limit_end_requests_with_error(tiny_llama_path, caplog):
    fake = RecoverableFakeExecutor(32, fail_at_steps=(2, 4))
    engine = _engine(tiny_llama_path, fake, max_rank_restarts=1)
    with caplog.at_level("ERROR", logger="pagedray.cluster.engine"):
        _, reasons, errors = _run(engine)
    assert fake.num_rebuilds == 1
    assert set(reasons.values()) == {"error"} and errors[0] == ENGINE_DEAD_MESSAGE   # the why is in the log only
    assert "max_rank_restarts=1" in caplog.text
    with pytest.raises(EngineDeadError):
        engine.check_health()
    _assert_idle_and_clean(engine)


def test_recovery_disabled_or_failed_rebuild_or_incurable_error_fails_cleanly(tiny_llama_path, caplog):
    cases = [(RecoverableFakeExecutor(32, fail_at_steps=(2,)), 0, "max_rank_restarts=0"),
             (RecoverableFakeExecutor(32, fail_at_steps=(2,), rebuild_fails=True), 3, "rebuilding the TP group failed"),
             (FakeExecutor(32, fail_at_step=2), 3, "simulated rank failure")]
    for fake, limit, message in cases:
        engine = _engine(tiny_llama_path, fake, max_rank_restarts=limit)
        caplog.clear()
        with caplog.at_level("ERROR", logger="pagedray.cluster.engine"):
            _, reasons, errors = _run(engine)
        assert set(reasons.values()) == {"error"} and errors[0] == ENGINE_DEAD_MESSAGE and message in caplog.text
        assert getattr(fake, "num_rebuilds", 0) == 0
        _assert_idle_and_clean(engine)


def test_max_rank_restarts_is_validated():
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="max_rank_restarts"):
            ParallelConfig(max_rank_restarts=bad).validate()


def test_async_engine_reports_unhealthy_while_rebuilding_and_streams_resume(tiny_llama_path):
    """The rebuild takes longer than the stall watchdog's grace: it must not end the streams. Meanwhile the
    replica is not ready (/health 503, routers send elsewhere) but alive: Serve's hook passes, so Serve does not
    replace the replica whose streams the rebuild resumes (it did after three checks, ~15 s, on a loaded
    machine). The test holds the rebuild until it has looked."""
    import asyncio
    import threading

    from pagedray.cluster.async_engine import STALL_GRACE_FACTOR, AsyncEngine
    from pagedray.deploy.serve.served_engine import ServedEngine

    step_timeout_s = 0.2
    rebuild_s = STALL_GRACE_FACTOR * step_timeout_s + 0.5
    expected, _, _ = _run(_engine(tiny_llama_path, FakeExecutor(32)))
    hold = threading.Event()
    fake = RecoverableFakeExecutor(32, fail_at_steps=(2,), rebuild_s=rebuild_s, hold=hold)
    config = EngineConfig(model=ModelConfig(model=tiny_llama_path), cache=CacheConfig(block_size=8, num_blocks=32),
                          step_timeout_s=step_timeout_s, step_timeout_per_token_s=0.0)
    engine = AsyncEngine(config, executor=fake)
    served = object.__new__(ServedEngine)          # the replica's view of this engine
    served._engine, served._draining, served._closed, served._config = engine, False, False, config

    async def consume(rid):
        tokens = {}
        params = SamplingParams(temperature=0, max_tokens=12, n=2 if rid == "c" else 1)
        async for out in engine.generate(rid, PROMPTS[rid], params):
            assert out.error is None, out.error
            for c in out.outputs:
                tokens.setdefault((rid, c.index), []).extend(c.token_ids)
        return tokens

    async def main():
        tasks = [asyncio.create_task(consume(rid)) for rid in PROMPTS]
        assert await asyncio.to_thread(fake.rebuilding.wait, 60)
        with pytest.raises(EngineDeadError, match="being rebuilt"):
            await engine.check_health()
        with pytest.raises(EngineDeadError, match="being rebuilt"):
            await served.check_ready()                 # /health: 503
        assert not (await served.routing_stats("r0", 0))["healthy"]   # routers: elsewhere
        await engine.check_alive()
        await served.check_health()                    # Serve's hook: alive
        hold.set()
        merged = {}
        for part in await asyncio.gather(*tasks):
            merged.update(part)
        await engine.check_health()
        await served.check_ready()
        return merged
    try:
        assert asyncio.run(main()) == expected
        assert fake.num_rebuilds == 1
        _assert_idle_and_clean(engine.engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("warm_prefix_tokens", [8192, 0])
def test_a_rebuilt_group_prefills_the_prefixes_the_lost_cache_reused(tiny_llama_path, warm_prefix_tokens):
    """After a rebuild the engine re-prefills, as internal requests whose outputs nobody sees, the prefixes
    its prefix hits reused most before: a request after the rebuild finds its shared prefix cached
    (with ``warm_prefix_tokens`` 0 it recomputes it)."""
    config = EngineConfig(model=ModelConfig(model=tiny_llama_path),
                          cache=CacheConfig(block_size=8, num_blocks=32, warm_prefix_tokens=warm_prefix_tokens))
    fake = RecoverableFakeExecutor(32)
    engine = Engine(config, executor=fake)
    shared = list(range(200, 216))                             # two full blocks
    params = SamplingParams(temperature=0, max_tokens=3)

    def run(requests):
        seen = {}
        for rid, prompt in requests.items():
            engine.add(rid, prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                seen.setdefault(out.request_id, out.num_cached_prompt_tokens)
        return seen

    run({f"history-{i}": shared + [i, i + 1] for i in range(3)})   # 2 prefix hits on the shared blocks
    fake.fail_at_steps = {len(fake.plans) + 1}                   # the rank dies during the next request
    assert set(run({"unrelated": [7, 8, 9]})) == {"unrelated"}    # no warm-up output reaches a caller
    assert fake.num_rebuilds == 1 and engine._warm_up_ids == set()
    assert run({"after": shared + [50, 51]}) == {"after": 16 if warm_prefix_tokens else 0}
    _assert_idle_and_clean(engine)
