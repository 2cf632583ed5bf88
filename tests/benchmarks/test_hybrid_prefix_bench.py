"""benchmarks.hybrid_prefix's workload on the tiny hybrid: later turns are served from the state snapshots (their
cached prompt tokens counted), none with ``hybrid_prefix_states=0``."""

from __future__ import annotations

from pagedray.cluster import LLM

from benchmarks.hybrid_prefix import conversation_turns


def test_later_turns_hit_with_snapshots_and_never_without(tiny_model_path):
    path = tiny_model_path("qwen3.5")
    results = {}
    for states in (4, 0):
        llm = LLM(path, dtype="float32", block_size=8, num_blocks=96, threads_per_worker=1, hybrid_prefix_states=states)
        try:
            results[states] = conversation_turns(llm, convs=2, turns=3, first_len=20, user_len=6, max_tokens=4,
                                                 seed=1, vocab=250)
        finally:
            llm.shutdown()
    # turn 2 (30 tokens) resumes at 16, turn 1's last full block (turn 1 computed 23 tokens: no decode snapshot);
    # turn 3 (40 tokens) at 32, where turn 2's decode ended a block (30 + 3 computed tokens)
    assert results[4]["cached_prompt_tokens"] == 2 * (16 + 32)
    assert results[0]["cached_prompt_tokens"] == 0
    assert results[4]["prompt_tokens"] == results[0]["prompt_tokens"] == 2 * (20 + 30 + 40)
