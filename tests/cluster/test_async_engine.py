"""AsyncEngine over the FakeExecutor test doubles: streams, intake while a step runs, cancellation,
failure, stall detection, drain."""

import asyncio

import pytest
from helpers.fake_executor import FakeClock, FakeExecutor, GatedFakeExecutor, PacedFakeExecutor
from pagedray.cluster.async_engine import IDLE_BATCH_WAITS, REPLACEMENT_WAITS, AsyncEngine
from pagedray.cluster.engine import ENGINE_DEAD_MESSAGE
from pagedray.cluster.outputs import EngineDeadError, EngineDrainingError
from pagedray.workers.contract.config import CacheConfig, EngineConfig, ModelConfig
from pagedray.workers.contract.sampling_params import SamplingParams


def _engine(path, executor, step_timeout_s=60.0, clock=None, stream_interval=1, step_timeout_per_token_s=0.0):
    config = EngineConfig(model=ModelConfig(model=path), cache=CacheConfig(block_size=8, num_blocks=64),
                          step_timeout_s=step_timeout_s, step_timeout_per_token_s=step_timeout_per_token_s,
                          stream_interval=stream_interval)
    if clock is None:
        return AsyncEngine(config, executor=executor)
    return AsyncEngine(config, executor=executor, clock=clock)


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


def test_stream_interval_merges_step_outputs_but_not_the_first_or_last(tiny_llama_path):
    """stream_interval=3: the first output alone, then one delta per 3 steps, the final output at once;
    the same tokens as stream_interval=1, which yields one output per step."""
    results = {}
    for interval in (1, 3):
        engine = _engine(tiny_llama_path, FakeExecutor(64), stream_interval=interval)
        try:
            results[interval] = asyncio.run(_consume(engine, "a", [10, 11], 8))
        finally:
            engine.shutdown()
    (tokens_1, outs_1), (tokens_3, outs_3) = results[1], results[3]
    assert tokens_1 == tokens_3 == list(range(12, 20))
    assert [len(o.outputs[0].token_ids) for o in outs_1] == [1] * 8
    assert [len(o.outputs[0].token_ids) for o in outs_3] == [1, 3, 3, 1]
    assert outs_3[0].prompt_token_ids == [10, 11] and outs_3[-1].finished
    assert outs_3[-1].outputs[0].finish_reason == "length" and not any(o.finished for o in outs_3[:-1])


def test_intake_abort_and_stats_do_not_wait_for_a_running_step(tiny_llama_path):
    fake = GatedFakeExecutor(64)
    engine = _engine(tiny_llama_path, fake)

    async def main():
        first = asyncio.create_task(_consume(engine, "a", [10, 11], 3))
        await asyncio.to_thread(fake.entered.wait, 10)       # step 0 is now blocked inside execute
        second = engine.generate("b", [20], SamplingParams(max_tokens=2, temperature=0))
        pending = asyncio.create_task(second.__anext__())
        await asyncio.sleep(0)                                # the add is queued while the step blocks
        assert await asyncio.wait_for(engine.abort("b"), timeout=60) is True
        # the snapshot of the last finished step: step 0 is still blocked, so none has finished
        assert (await asyncio.wait_for(engine.stats(), timeout=60)).num_steps_total == 0
        fake.gate.set()
        out_b = await asyncio.wait_for(pending, timeout=60)
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
        assert outs[-1].error == ENGINE_DEAD_MESSAGE   # the failure itself is logged, not handed to callers


def test_slow_step_fails_health_check_until_it_returns(tiny_llama_path):
    # a step slower than step_timeout_s but back before the watchdog's grace (2 x) ends nothing;
    # the engine's clock is fake, so a loaded machine cannot push the step past the grace
    fake, clock = GatedFakeExecutor(64), FakeClock()
    engine = _engine(tiny_llama_path, fake, step_timeout_s=1.0, clock=clock)

    async def main():
        task = asyncio.create_task(_consume(engine, "a", [3], 2))
        await asyncio.to_thread(fake.entered.wait, 60)
        await engine.check_health()                      # just started: healthy
        clock.advance(1.5)
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


def test_step_limit_grows_with_the_tokens_in_the_step(tiny_llama_path):
    # a 40-token prefill step gets 1 s + 40 x 0.1 s: busy, not dead, where a decode step's limit has passed
    fake, clock = GatedFakeExecutor(64), FakeClock()
    engine = _engine(tiny_llama_path, fake, step_timeout_s=1.0, clock=clock, step_timeout_per_token_s=0.1)

    async def main():
        task = asyncio.create_task(_consume(engine, "a", list(range(3, 43)), 2))
        await asyncio.to_thread(fake.entered.wait, 60)
        assert engine.engine.step_limit_s == pytest.approx(5.0)
        clock.advance(4.5)
        await engine.check_health()                      # past 1 s, within the prefill's 5 s
        clock.advance(1.0)
        with pytest.raises(EngineDeadError, match="its limit of 5.0 s"):
            await engine.check_health()
        fake.gate.set()
        tokens, _ = await task
        await engine.check_health()
        return tokens
    try:
        assert asyncio.run(main()) == [43, 44]
    finally:
        engine.shutdown()


def test_step_limit_config_is_validated():
    with pytest.raises(ValueError, match="step_timeout_per_token_s"):
        EngineConfig(step_timeout_per_token_s=-0.1)
    assert EngineConfig(step_timeout_s=10.0, step_timeout_per_token_s=0.5).step_limit_s(4) == 12.0


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


def test_drain_aborts_what_is_still_running_at_the_timeout(tiny_llama_path):
    # each step takes 1 s of the engine's fake clock; the drain's 5 s deadline passes while "long" runs
    clock = FakeClock()
    fake = PacedFakeExecutor(64, clock, step_s=1.0)
    engine = _engine(tiny_llama_path, fake, clock=clock)

    async def main():
        short = asyncio.create_task(_consume(engine, "short", [3], 2))
        long = asyncio.create_task(_consume(engine, "long", [7], 200))
        await asyncio.to_thread(fake.entered.wait, 60)
        drain = asyncio.create_task(engine.drain(timeout_s=5))
        await asyncio.sleep(0)                           # the drain has read its deadline: clock + 5
        fake.hold_at = clock() + 7                       # steps stop there until the drain has aborted
        aborts = []
        abort = engine.abort

        async def abort_then_release(request_id):
            aborts.append(request_id)
            result = await abort(request_id)
            fake.release.set()
            return result
        engine.abort = abort_then_release
        fake.gate.set()
        aborted = await drain
        return aborted, aborts, await short, await long
    try:
        aborted, aborts, (short_tokens, short_outs), (long_tokens, long_outs) = asyncio.run(main())
    finally:
        engine.shutdown()
    assert aborted == 1 and aborts == ["long"]
    assert short_tokens == [4, 5] and short_outs[-1].outputs[0].finish_reason == "length"
    assert 5 <= len(long_tokens) < 200 and long_outs[-1].outputs[0].finish_reason == "abort"
    assert long_tokens == list(range(8, 8 + len(long_tokens)))
    bm = engine.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_hand_over_drain_ends_streams_as_a_lost_replicas(tiny_llama_path):
    """``drain(0, hand_over=True)`` (a replica Serve removes): the stream still running ends with an output
    marked ``engine_failed`` (the ingress continues it elsewhere, deploy/serve/failover.py), not "abort";
    its sequence is aborted in the engine and every block comes back."""
    clock = FakeClock()
    fake = PacedFakeExecutor(64, clock, step_s=1.0)
    fake.hold_at = clock() + 3                           # the 4th step waits: "long" is surely in flight
    engine = _engine(tiny_llama_path, fake, clock=clock)

    async def main():
        long = asyncio.create_task(_consume(engine, "long", [7], 200))
        fake.gate.set()
        await asyncio.to_thread(fake.holding.wait, 60)
        drain = asyncio.create_task(engine.drain(timeout_s=0, hand_over=True))
        tokens, outs = await long                        # ended by the hand-over, the step still held
        fake.release.set()
        return await drain, tokens, outs
    try:
        handed_over, tokens, outs = asyncio.run(main())
    finally:
        engine.shutdown()
    last = outs[-1]
    assert handed_over == 1 and last.engine_failed and last.error.startswith("engine dead")
    assert [c.finish_reason for c in last.outputs] == ["error"] and 1 <= len(tokens) < 200
    bm = engine.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_reads_of_the_engine_state_run_between_steps_of_a_burst(tiny_llama_path):
    """``hot_prefixes`` / ``cached_prefix_hashes`` (the warm-up's and the router's reads) run on the step
    thread between two steps, also while steps run back to back: a read pushed during a held step runs at
    the next step boundary, with the long request still running (a read that waited for the burst to end
    timed out under load: the warm-up of a replica that scaled up read nothing)."""
    clock = FakeClock()
    fake = PacedFakeExecutor(64, clock, step_s=1.0)
    fake.hold_at = clock() + 3
    engine = _engine(tiny_llama_path, fake, clock=clock)
    seen = []

    async def main():
        long = asyncio.create_task(_consume(engine, "long", [7] * 20, 200))
        fake.gate.set()
        await asyncio.to_thread(fake.holding.wait, 60)
        read = asyncio.create_task(engine._between_steps(
            lambda: seen.append((len(fake.plans), engine.engine.has_unfinished_requests()))))
        await asyncio.sleep(0)
        fake.release.set()
        await read
        hot = await engine.hot_prefixes(64)
        await long
        return hot

    try:
        hot = asyncio.run(main())
    finally:
        engine.shutdown()
    assert seen == [(4, True)] and hot == []


def test_steps_run_back_to_back_while_the_event_loop_is_busy(tiny_llama_path):
    """The step thread does not wait for the event loop between steps: with the loop blocked right after
    the first output arrives, the later steps still run (the executor sees step 3, which needs step 2's
    tokens), and every output reaches the stream in order once the loop is free again."""
    import threading

    class CountingExecutor(FakeExecutor):
        def __init__(self, num_blocks):
            super().__init__(num_blocks)
            self.third_step = threading.Event()

        def execute(self, plan):
            result = super().execute(plan)
            if len(self.plans) == 3:
                self.third_step.set()
            return result

    executor = CountingExecutor(64)
    engine = _engine(tiny_llama_path, executor)

    async def main():
        tokens, ran_while_blocked = [], None
        async for out in engine.generate("a", [10, 11], SamplingParams(max_tokens=5, temperature=0)):
            tokens += out.outputs[0].token_ids
            if ran_while_blocked is None:   # block the event loop thread itself (not an await)
                ran_while_blocked = executor.third_step.wait(timeout=60)
        return tokens, ran_while_blocked
    try:
        tokens, ran_while_blocked = asyncio.run(main())
    finally:
        engine.shutdown()
    assert ran_while_blocked, "the third step waited for the blocked event loop"
    assert tokens == [12, 13, 14, 15, 16]


def test_a_request_is_validated_once_on_its_way_in(tiny_llama_path, monkeypatch):
    """The intake validates (argument checks, prompt ids against the vocabulary); the step thread only
    admits (id, queue): the scheduler's argument checks run once per request, not four times."""
    from pagedray.cluster import engine as engine_module

    calls = []
    original = engine_module.check_arguments
    monkeypatch.setattr(engine_module, "check_arguments", lambda *a, **k: (calls.append(a), original(*a, **k)))
    engine = _engine(tiny_llama_path, FakeExecutor(64))

    async def main():
        with pytest.raises(ValueError, match="prompt_token_ids"):
            await _consume(engine, "b", [10, 10**9], 3)
        return await _consume(engine, "a", [10, 11], 3)
    try:
        tokens, _ = asyncio.run(main())
    finally:
        engine.shutdown()
    assert tokens == [12, 13, 14] and len(calls) == 2          # one per request, the refused one included


class HeldSleep:
    """TEST DOUBLE of ``asyncio.sleep`` for the idle batch wait: each call is recorded; the first ``hold``
    calls block until the test releases them (no wall-clock window to race), later ones return at once."""

    def __init__(self, hold: int = 1000) -> None:
        self.calls: list[float] = []
        self.hold = hold
        self.entered = asyncio.Event()
        self._release = asyncio.Event()

    async def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)
        if len(self.calls) > self.hold:
            return
        self.entered.set()
        await self._release.wait()
        self._release.clear()

    async def next_pause(self) -> None:
        await asyncio.wait_for(self.entered.wait(), timeout=60)
        self.entered.clear()

    def release(self) -> None:
        self._release.set()


def _waiting_engine(path, fake, sleep: HeldSleep, wait_ms: float, clock: FakeClock | None = None) -> AsyncEngine:
    """The engine's clock (arrival and emptying times) is fake: it moves only when a test advances it."""
    config = EngineConfig(model=ModelConfig(model=path), cache=CacheConfig(block_size=8, num_blocks=64),
                          idle_batch_wait_ms=wait_ms)
    return AsyncEngine(config, executor=fake, sleep=sleep, clock=clock or FakeClock())


def test_idle_engine_lets_a_burst_arrive_before_its_first_step(tiny_llama_path):
    """Requests that arrive while an idle engine waits go into its first step together; the wait ends after
    a window with no new arrival (here: the second window), and a running engine never waits."""
    fake, sleep, clock = FakeExecutor(64), HeldSleep(hold=2), FakeClock()
    engine = _waiting_engine(tiny_llama_path, fake, sleep, 4.0, clock)

    async def main():
        first = asyncio.create_task(_consume(engine, "a", [10, 11], 3))
        await sleep.next_pause()                         # the engine is waiting; nothing has stepped
        assert fake.plans == []
        others = [asyncio.create_task(_consume(engine, rid, [20 + i], 3)) for i, rid in enumerate("bc")]
        await asyncio.sleep(0)                           # b and c are queued during the first window
        sleep.release()
        await sleep.next_pause()                         # new arrivals: one more window
        assert fake.plans == []
        sleep.release()                                  # a quiet window: the first step starts
        results = await asyncio.gather(first, *others)
        await engine._wait_idle(60)                      # the step loop is back to waiting for work
        clock.advance(1.0)                               # d comes long after a, b and c ended: no replacement
        late = await _consume(engine, "d", [30], 2)      # idle again: one (unheld) window
        return results, late
    try:
        results, late = asyncio.run(main())
    finally:
        engine.shutdown()
    assert sleep.calls == [0.004, 0.004, 0.004]          # a, a + b + c, then d alone; none while running
    assert len(fake.plans[0].new_seqs) == 3              # a, b and c prefilled in one step
    assert [tokens for tokens, _ in results] == [[12, 13, 14], [21, 22, 23], [22, 23, 24]]
    assert late[0] == [31, 32]


def test_idle_batch_wait_stops_after_its_last_window_and_zero_turns_it_off(tiny_llama_path):
    """Arrivals in every window: the engine steps after the last one anyway; with 0 it never pauses."""
    fake, sleep = FakeExecutor(64), HeldSleep()
    engine = _waiting_engine(tiny_llama_path, fake, sleep, 2.0)

    async def main():
        tasks = [asyncio.create_task(_consume(engine, "r0", [10], 2))]
        for i in range(1, IDLE_BATCH_WAITS + 1):
            await sleep.next_pause()
            tasks.append(asyncio.create_task(_consume(engine, f"r{i}", [10 + i], 2)))
            await asyncio.sleep(0)
            sleep.release()
        return await asyncio.gather(*tasks)
    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    assert len(sleep.calls) == IDLE_BATCH_WAITS          # capped: the last request arrived in the last window
    assert len(fake.plans[0].new_seqs) == IDLE_BATCH_WAITS + 1
    assert [tokens for tokens, _ in results] == [[11 + i, 12 + i] for i in range(IDLE_BATCH_WAITS + 1)]

    fake, sleep = FakeExecutor(64), HeldSleep()
    engine = _waiting_engine(tiny_llama_path, fake, sleep, 0)
    try:
        tokens, _ = asyncio.run(_consume(engine, "a", [10], 2))
    finally:
        engine.shutdown()
    assert tokens == [11, 12] and sleep.calls == []


def test_running_engine_does_not_wait_for_more_arrivals(tiny_llama_path):
    """A request that arrives while a step runs joins the next step with no pause."""
    fake, sleep = GatedFakeExecutor(64), HeldSleep(hold=0)
    engine = _waiting_engine(tiny_llama_path, fake, sleep, 4.0)

    async def main():
        first = asyncio.create_task(_consume(engine, "a", [10, 11], 3))
        await asyncio.to_thread(fake.entered.wait, 60)   # step 0 (a alone) is blocked inside execute
        second = asyncio.create_task(_consume(engine, "b", [20], 2))
        await asyncio.sleep(0)
        fake.gate.set()
        return await asyncio.gather(first, second)
    try:
        (tokens_a, _), (tokens_b, _) = asyncio.run(main())
    finally:
        engine.shutdown()
    assert sleep.calls == [0.004]                        # a's, from idle; none for b
    assert tokens_a == [12, 13, 14] and tokens_b == [21, 22]


def test_arrivals_during_the_step_that_empties_the_engine_wait_for_their_burst(tiny_llama_path):
    """b arrives while the step that finishes the engine's only request runs (a closed-loop client's next
    wave starting): the engine is idle after that step, so b waits a window for the rest of its burst (c)
    instead of being prefilled alone in the next step."""
    fake, sleep = GatedFakeExecutor(64), HeldSleep(hold=2)
    engine = _waiting_engine(tiny_llama_path, fake, sleep, 4.0)

    async def main():
        first = asyncio.create_task(_consume(engine, "a", [10, 11], 1))
        await sleep.next_pause()
        sleep.release()                                  # a's window was quiet: step 0 (a's last token)
        await asyncio.to_thread(fake.entered.wait, 60)   # step 0 is blocked inside execute
        second = asyncio.create_task(_consume(engine, "b", [20], 2))
        await asyncio.sleep(0)                           # b is queued during step 0
        fake.gate.set()
        await sleep.next_pause()                         # a finished: the engine waits for b's burst
        assert len(fake.plans) == 1
        third = asyncio.create_task(_consume(engine, "c", [30], 2))
        await asyncio.sleep(0)
        sleep.release()                                  # c came in that window: one more (quiet) window
        return await asyncio.gather(first, second, third)
    try:
        (tokens_a, _), (tokens_b, _), (tokens_c, _) = asyncio.run(main())
    finally:
        engine.shutdown()
    assert sleep.calls == [0.004, 0.004, 0.004]
    assert [len(plan.new_seqs) for plan in fake.plans[:2]] == [1, 2]   # b and c prefilled in one step
    assert tokens_a == [12] and tokens_b == [21, 22] and tokens_c == [31, 32]


async def _two_finish_in_one_step(engine):
    """a and b arrive together at an idle engine and end in its first step (one token each); returns once
    the step loop is idle again. Without that wait, a request sent next could reach the step thread while
    it still runs the release-only step after a and b, and be stepped in that burst without any idle wait:
    a race a loaded machine lost. The engine's clock is fake, so the wait does not age the emptying step."""
    finished = await asyncio.gather(_consume(engine, "a", [10], 1), _consume(engine, "b", [20], 1))
    await engine._wait_idle(60)
    return finished


def test_replacements_of_the_requests_that_just_finished_are_awaited_past_a_quiet_window(tiny_llama_path):
    """a and b end in the step that empties the engine; c arrives at once (a closed-loop client's next request):
    the engine expects two replacements, so a quiet window does not end its wait until d is there too, then one
    more quiet window. The next step prefills c and d together."""
    fake, sleep = FakeExecutor(64), HeldSleep(hold=4)
    engine = _waiting_engine(tiny_llama_path, fake, sleep, 4.0)

    async def main():
        pair = asyncio.create_task(_two_finish_in_one_step(engine))
        await sleep.next_pause()                         # a and b's burst: one quiet window
        sleep.release()
        finished = await pair
        third = asyncio.create_task(_consume(engine, "c", [30], 2))
        await sleep.next_pause()
        sleep.release()                                  # quiet, but only one of the two replacements is here
        await sleep.next_pause()
        assert len(fake.plans) <= 2 and all(not plan.new_seqs for plan in fake.plans[1:])   # c is not stepped
        fourth = asyncio.create_task(_consume(engine, "d", [40], 2))
        await asyncio.sleep(0)
        sleep.release()                                  # d came: one more window, a quiet one
        await sleep.next_pause()
        sleep.release()
        return finished, await asyncio.gather(third, fourth)
    try:
        finished, later = asyncio.run(main())
    finally:
        engine.shutdown()
    assert sleep.calls == [0.004] * 4
    assert [tokens for tokens, _ in finished] == [[11], [21]]
    stepped = [len(plan.new_seqs) for plan in fake.plans if plan.new_seqs]
    assert stepped == [2, 2]                             # a + b, then c + d
    assert [tokens for tokens, _ in later] == [[31, 32], [41, 42]]


def test_the_wait_for_replacements_that_do_not_come_is_capped(tiny_llama_path):
    """Only c replaces a and b: the engine steps after REPLACEMENT_WAITS windows."""
    fake, sleep = FakeExecutor(64), HeldSleep(hold=0)
    engine = _waiting_engine(tiny_llama_path, fake, sleep, 4.0)

    async def main():
        await _two_finish_in_one_step(engine)
        return await _consume(engine, "c", [30], 2)
    try:
        tokens, _ = asyncio.run(main())
    finally:
        engine.shutdown()
    assert len(sleep.calls) == 1 + REPLACEMENT_WAITS     # a and b's window, then c's capped wait
    assert tokens == [31, 32]
