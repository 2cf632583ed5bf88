"""Rebalancing between live replicas (#65, deploy/serve/rebalance.py): a busy replica hands running requests over
with their KV blocks (``ServedEngine.hand_over``), the failover client continues each at once on another replica
(``exclude``: not the one it left; not a failover), and the streams go on token for token. Two served engines in
one process; the decision rule and the pacing with fakes."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest
from helpers.engine_runs import collect_tokens
from pagedray.deploy.serve.failover import MAX_MOVES, FailoverEngineClient
from pagedray.deploy.serve.rebalance import COOLDOWN_S, Rebalancer, surplus
from pagedray.deploy.serve.served_engine import ServedEngine
from pagedray.workers.contract.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from pagedray.workers.contract.sampling_params import SamplingParams

BLOCK = 8
NUM_BLOCKS = 128


def _engine(path) -> ServedEngine:
    return ServedEngine(EngineConfig(model=ModelConfig(model=path, dtype="float32"),
                                     cache=CacheConfig(block_size=BLOCK, num_blocks=NUM_BLOCKS),
                                     parallel=ParallelConfig(executor="local", threads_per_worker=1)))


def _summary(replica: str, running: int, waiting: int = 0, healthy: bool = True) -> dict:
    return {"replica": replica, "stats": {"num_running": running, "num_waiting": waiting}, "healthy": healthy}


def test_a_replica_hands_over_half_its_excess_over_the_least_loaded_healthy_peer_above_the_threshold():
    peers = [_summary("me", 9), _summary("b", 4), _summary("c", 1), _summary("sick", 0, healthy=False)]
    assert surplus(9, peers, "me", threshold=2) == 4          # (9 - 1) // 2: c; the unhealthy one is no target
    assert surplus(9, peers, "me", threshold=8) == 0          # an excess of 8 is not above 8
    assert surplus(3, peers, "me", threshold=1) == 1
    assert surplus(1, peers, "me", threshold=1) == 0          # not busier than c
    assert surplus(9, peers, "me", threshold=0) == 0          # off
    assert surplus(9, [_summary("me", 9)], "me", threshold=1) == 0   # no peer
    assert surplus(5, [_summary("c", 0, waiting=3)], "me", threshold=1) == 1   # waiting requests are load too
    with pytest.raises(ValueError, match="threshold"):
        surplus(9, peers, "me", threshold=-1)


class FakeServed:
    def __init__(self, running: int) -> None:
        self.running, self.calls = running, []

    async def stats(self):
        return SimpleNamespace(num_running=self.running, num_waiting=0)

    async def hand_over(self, count: int, source: str) -> list[str]:
        self.calls.append((count, source))
        moved = [f"r{i}" for i in range(min(count, self.running))]
        self.running -= len(moved)
        return moved


def test_the_rebalancer_moves_then_waits_for_the_summaries_to_show_the_move():
    now = [100.0]
    served = FakeServed(running=10)
    summaries = [_summary("me", 10), _summary("b", 2)]
    rebalancer = Rebalancer(served, "me", lambda: summaries, threshold=2, clock=lambda: now[0])

    async def scenario():
        assert await rebalancer.tick() == 4 and served.calls == [(4, "me")]
        now[0] += COOLDOWN_S / 2
        assert await rebalancer.tick() == 0 and len(served.calls) == 1      # within the cool-down: no decision
        now[0] += COOLDOWN_S
        summaries[1] = _summary("b", 6)                                     # the peer's summary shows the move
        assert await rebalancer.tick() == 0 and len(served.calls) == 1      # 6 vs 6: balanced
        served.running = 12
        assert await rebalancer.tick() == 3 and served.calls[-1] == (3, "me")
    asyncio.run(scenario())
    assert rebalancer.report() == {"threshold": 2, "moves": 2, "moved_requests": 7}
    with pytest.raises(ValueError, match="rebalance_threshold"):
        Rebalancer(served, "me", lambda: summaries, threshold=0)


class ByExclude:
    """The router as a moved request sees it: a call naming ``exclude`` goes to the other engine. What each call
    carried: (engine index, request id, resume tokens, kv, exclude)."""

    def __init__(self, engines: dict[str, ServedEngine], first: str) -> None:
        self.engines, self.first, self.calls = engines, first, []

    def generate(self, request_id, prompt, params, resume_tokens=(), lora=None, session=None, tenant=None, kv=None,
                 exclude=None):
        name = self.first if exclude is None else next(n for n in self.engines if n != exclude)
        self.calls.append((name, request_id, list(resume_tokens), kv, exclude))
        return self.engines[name].generate(request_id, prompt, params, resume_tokens, lora, session, tenant, kv,
                                           exclude)


PARAMS = [SamplingParams(temperature=0, max_tokens=120, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=11, max_tokens=120, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=160, ignore_eos=True),
          SamplingParams(temperature=0.7, seed=5, max_tokens=100, ignore_eos=True)]


def test_running_requests_move_to_a_peer_with_their_blocks_and_every_stream_goes_on_exactly(tiny_llama_path):
    rng = random.Random(17)
    prompts = [[rng.randrange(2, 500) for _ in range(30 + 5 * i)] for i in range(len(PARAMS))]

    async def main():
        single, busy, idle = _engine(tiny_llama_path), _engine(tiny_llama_path), _engine(tiny_llama_path)
        try:
            expected = [await collect_tokens(single.generate(f"s{i}", p, params))
                        for i, (p, params) in enumerate(zip(prompts, PARAMS))]
            routing = ByExclude({"busy": busy, "idle": idle}, first="busy")
            moves, failovers = [], []
            client = FailoverEngineClient(routing, on_failover=lambda: failovers.append(1),
                                          on_move=lambda: moves.append(1))
            started, handed = [0] * len(PARAMS), []

            def count(i):
                def on_token(n: int) -> None:
                    started[i] = n
                    if min(started) >= 4 and not handed:    # every request is running: move two of them
                        handed.append(asyncio.ensure_future(busy.hand_over(2, "busy")))
                return on_token
            tokens = await asyncio.gather(*(collect_tokens(client.generate(f"req{i}", p, params), count(i))
                                            for i, (p, params) in enumerate(zip(prompts, PARAMS))))
            moved = await handed[0]
            # a request moved to idle is never moved again from there; nothing is left to move
            again = await idle.hand_over(4, "idle")
            busy_stats, idle_stats = await busy.stats(), await idle.stats()
            return expected, tokens, moved, again, routing.calls, moves, failovers, busy_stats, idle_stats
        finally:
            await single.close()
            await busy.close()
            await idle.close()

    expected, tokens, moved, again, calls, moves, failovers, busy_stats, idle_stats = asyncio.run(main())
    assert tokens == expected
    # the two with the most tokens left (160, then 120 of which fewer were made) moved, with their blocks
    assert len(moved) == 2 and "req2" in moved and again == []
    assert len(moves) == 2 and failovers == []
    continued = [call for call in calls if call[4] is not None]
    assert [(name, exclude) for name, _, _, _, exclude in continued] == [("idle", "busy")] * 2
    for _, request_id, resumed, kv, _ in continued:
        original = int(request_id.split(":")[0][3:])
        assert request_id == f"req{original}:moved1" and len(resumed) >= 4
        assert kv is not None and kv.num_blocks >= len(prompts[original]) // BLOCK
        assert kv.token_ids == (prompts[original] + expected[original])[:kv.num_blocks * BLOCK]
    # the moved requests found their prompt and output so far cached on idle: nothing leaked on either side
    assert idle_stats.prefix_hit_tokens_total >= sum(len(prompts[int(r[3:])]) // BLOCK * BLOCK for r in moved)
    for stats in (busy_stats, idle_stats):
        assert stats.num_running == 0 and stats.num_waiting == 0
        assert stats.kv_usage == 0.0 and stats.num_free_blocks == stats.num_blocks


def test_moves_are_not_failovers_and_are_bounded():
    """An output marked ``moved_from`` is continued at once on another replica, MAX_MOVES times at most; a
    replica that keeps moving the request after that makes it a failover (bounded by MAX_FAILOVERS)."""
    from pagedray.cluster.outputs import CompletionOutput, RequestOutput

    class Mover:
        def __init__(self) -> None:
            self.calls = []

        async def generate(self, request_id, prompt, params, resume_tokens=(), lora=None, session=None,
                           tenant=None, kv=None, exclude=None):
            self.calls.append((request_id, list(resume_tokens), exclude))
            index = len(self.calls)
            done = len(resume_tokens) + 1 >= params.max_tokens
            yield RequestOutput(request_id, [CompletionOutput(0, [index], finish_reason="length" if done else None)],
                                finished=done)
            if not done:
                yield RequestOutput(request_id, [CompletionOutput(0, [], finish_reason="error")], finished=True,
                                    error="moved", engine_failed=True, moved_from=f"r{index}")

    async def main(max_tokens):
        inner, failovers = Mover(), []
        client = FailoverEngineClient(inner, on_failover=lambda: failovers.append(1), sleep=_no_sleep)
        tokens = await collect_tokens(client.generate("x", [1, 2, 3], SamplingParams(max_tokens=max_tokens)))
        return tokens, inner.calls, failovers

    tokens, calls, failovers = asyncio.run(main(5))
    assert tokens == [1, 2, 3, 4, 5] and failovers == []
    assert [c[0] for c in calls] == ["x", "x:moved1", "x:moved2", "x:moved3", "x:moved4"]
    assert [c[2] for c in calls] == [None, "r1", "r2", "r3", "r4"] and calls[-1][1] == [1, 2, 3, 4]
    tokens, calls, failovers = asyncio.run(main(MAX_MOVES + 3))
    assert tokens == list(range(1, MAX_MOVES + 4)) and len(failovers) == 2
    assert calls[MAX_MOVES + 1][0] == "x:failover1" and calls[MAX_MOVES + 1][2] is None


async def _no_sleep(_seconds: float) -> None:
    return None
