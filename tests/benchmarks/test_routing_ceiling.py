"""benchmarks/routing_ceiling.py: the model-free replay of the routing workload over two real BlockManagers."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.routing import NUM_SYSTEMS, TURNS
from benchmarks.routing_ceiling import (
    ROUTERS,
    conversation_requests,
    independent_requests,
    question_range,
    replay,
    sweep,
)

SYSTEM_TOKENS = 256   # 16 full blocks of 16


@pytest.fixture(scope="module")
def independent():
    return independent_requests(seed=3, system_tokens=SYSTEM_TOKENS, question_tokens=(10, 20), max_tokens=8)


def test_independent_workload_is_every_system_prompt_times_every_turn(independent):
    assert len(independent) == NUM_SYSTEMS * TURNS
    assert sorted(r.source for r in independent) == sorted(list(range(NUM_SYSTEMS)) * TURNS)
    for request in independent:
        system = next(r.prompt[:SYSTEM_TOKENS] for r in independent if r.source == request.source)
        assert request.prompt[:SYSTEM_TOKENS] == system and 10 <= len(request.prompt) - SYSTEM_TOKENS <= 20
    assert len({tuple(r.prompt[:SYSTEM_TOKENS]) for r in independent}) == NUM_SYSTEMS


def test_a_chat_turn_extends_the_chats_previous_turn_with_its_answer():
    requests = conversation_requests(seed=1, system_tokens=64, question_tokens=(4, 6), max_tokens=3)
    assert len(requests) == NUM_SYSTEMS * TURNS
    last: dict[int, list[int]] = {}
    for request in requests:
        if request.source in last:
            assert request.prompt[:len(last[request.source])] == last[request.source]
        last[request.source] = request.prompt + request.answer


def test_with_room_for_everything_only_first_requests_miss(independent):
    """1,024 blocks per replica evict nothing: a request hits its whole system prompt (16 blocks) unless it is
    the first of its system prompt on that replica. A partition and cache-aware routing send each system
    prompt to one replica (8 misses); random routing misses once per (system prompt, replica) pair it used."""
    full = (NUM_SYSTEMS * TURNS - NUM_SYSTEMS) * SYSTEM_TOKENS
    results = {router: replay(router, independent, num_blocks=1024, seed=0) for router in ROUTERS}
    assert results["partition"]["hit_tokens"] == full
    assert results["cache_aware"]["hit_tokens"] == full
    assert full - NUM_SYSTEMS * SYSTEM_TOKENS <= results["random"]["hit_tokens"] < full
    assert results["partition"]["busiest_share"] == results["cache_aware"]["busiest_share"] == 0.5


def test_a_small_cache_costs_random_routing_more_than_cache_aware(independent):
    """Each replica holds about two system prompts (40 blocks): random routing sends it all 8, cache-aware 4."""
    aware, random_ = (replay(router, independent, num_blocks=40, seed=0) for router in ("cache_aware", "random"))
    assert random_["hit_tokens"] < aware["hit_tokens"] < (NUM_SYSTEMS * TURNS - NUM_SYSTEMS) * SYSTEM_TOKENS


def test_the_sweep_reports_each_router_and_the_ratios_to_random():
    rows = sweep("independent", [32, 1024], seeds=2, system_tokens=64, question_tokens=(4, 8), max_tokens=4)
    assert [row["num_blocks"] for row in rows] == [32, 1024]
    for row in rows:
        assert set(row) == {"num_blocks", *ROUTERS}
        assert "hit_tokens_vs_random" not in row["random"]
        for router in ("cache_aware", "partition"):
            ratio = row[router]["hit_tokens_vs_random"]
            assert ratio.low <= ratio.median <= ratio.high and ratio.rounds == (0, 1)
    roomy = rows[1]  # nothing evicted: random routing misses at least as often as either other router
    assert roomy["cache_aware"]["hit_tokens_vs_random"].low >= 1.0
    assert roomy["partition"]["hit_tokens_vs_random"].low >= 1.0


def test_a_cache_too_small_for_one_request_is_refused(independent):
    with pytest.raises(ValueError, match="num_blocks"):
        replay("random", independent, num_blocks=16, seed=0)


def test_question_tokens_is_a_low_high_pair():
    assert question_range("10,20") == (10, 20)
    for bad in ("10", "x,2", "0,4", "5,4"):
        with pytest.raises(argparse.ArgumentTypeError):
            question_range(bad)
