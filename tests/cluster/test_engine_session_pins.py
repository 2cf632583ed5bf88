"""Session pins in the engine: an agent's next turn finds its last prompt and output cached after other
requests evicted every unpinned block, and its tokens equal transformers'; without a session (or after the
pins' TTL, on the scheduler's own clock) the same pressure leaves nothing cached."""

from __future__ import annotations

import random

import pytest
from helpers.engine_runs import run_alone
from helpers.hf_oracle import hf_greedy
from pagedray.cluster import LLM, SamplingParams

BLOCK = 8
TURN_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=TURN_TOKENS, ignore_eos=True)


def _two_turns(path: str, session: str | None, pause_s: float = 0.0) -> tuple[list[int], list[int], int]:
    """Turn 1, ``pause_s`` on the scheduler's clock, a flood of other prompts that fills the pool several times,
    then turn 2 (turn 1's prompt and output plus new tokens): (turn 2's prompt, its tokens, its cached prompt
    tokens)."""
    rng = random.Random(3)
    first = [rng.randrange(2, 500) for _ in range(27)]
    now = [0.0]
    with LLM(path, dtype="float32", block_size=BLOCK, num_blocks=24, watermark=0.0, threads_per_worker=1,
             kv_pin_ttl_s=60.0, kv_pin_max_fraction=0.5) as llm:
        llm.engine.scheduler.clock = lambda: now[0]
        output, _ = run_alone(llm.engine, "turn1", first, GREEDY, session=session)
        now[0] += pause_s                                    # the pins expire at the flood's first step
        for i in range(6):                                   # 6 x 6 blocks: every unpinned block is taken
            run_alone(llm.engine, f"flood{i}", [rng.randrange(2, 500) for _ in range(40)], GREEDY)
        second = first + output + [rng.randrange(2, 500) for _ in range(5)]
        tokens, cached = run_alone(llm.engine, "turn2", second, GREEDY, session=session)
        stats = llm.engine.block_manager.stats()
        assert stats.num_pinned_blocks <= 12
        llm.engine.block_manager.check_invariants()
    return second, tokens, cached


@pytest.fixture(scope="module")
def pinned_run(tiny_llama_path):
    return _two_turns(tiny_llama_path, "agent-7")


def test_a_sessions_next_turn_finds_its_blocks_after_the_pool_was_flooded(pinned_run, tiny_hf_model):
    second, tokens, cached = pinned_run
    assert cached == (27 + TURN_TOKENS - 1) // BLOCK * BLOCK          # every full block of turn 1's prompt + output
    assert tokens == hf_greedy(tiny_hf_model, second, TURN_TOKENS)


def test_without_a_session_or_after_the_ttl_the_flood_leaves_nothing_cached(tiny_llama_path, pinned_run):
    _, tokens, cached = _two_turns(tiny_llama_path, None)
    assert cached == 0 and tokens == pinned_run[1]
    _, tokens, cached = _two_turns(tiny_llama_path, "agent-7", pause_s=61.0)
    assert cached == 0 and tokens == pinned_run[1]


def test_a_bad_session_is_refused_naming_it(tiny_llama_path):
    with LLM(tiny_llama_path, dtype="float32", block_size=BLOCK, num_blocks=24, threads_per_worker=1) as llm:
        for session in ("", "x" * 257, 5):
            with pytest.raises(ValueError, match="session"):
                llm.engine.add("r", [1, 2, 3], GREEDY, session=session)
        assert not llm.engine.has_unfinished_requests()
