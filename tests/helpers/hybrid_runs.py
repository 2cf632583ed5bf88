"""A hybrid model's prefix cache through ``LLM`` (cluster/hybrid.py, block_manager/state_pool.py): a conversation
and a shared system prompt whose hits are asserted to the token and whose tokens must equal transformers'.
Used by tests/cluster/test_hybrid_prefix_cache.py (CPU, Ray TP=2) and tests/workers/test_worker_gpu.py (CUDA)."""

from __future__ import annotations

import random

from pagedray.cluster import LLM, SamplingParams

from helpers.hf_oracle import hf_greedy_each

BLOCK, NEW = 8, 12


def hybrid_llm(path: str, async_scheduling: bool = False, tp: int = 1, **kwargs) -> LLM:
    """The tiny hybrid with 4 state snapshots, fp32, 8-token blocks (``kwargs``: more engine options)."""
    return LLM(path, dtype="float32", block_size=BLOCK, num_blocks=64, threads_per_worker=1, tensor_parallel_size=tp,
               enable_prefix_caching=True, hybrid_prefix_states=4, async_scheduling=async_scheduling, **kwargs)


def _one(llm: LLM, prompt: list[int]) -> tuple[list[int], int]:
    result = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)[0]
    return result.outputs[0].token_ids, result.num_cached_prompt_tokens


def conversation_and_system_prompt(path: str, llm: LLM) -> None:
    """Three turns of a conversation, then three prompts sharing a system prompt, one at a time (shuts ``llm``
    down); asserts transformers' tokens, each prompt's hit and that every seat came back."""
    async_scheduling = llm.engine.config.scheduler.async_scheduling
    rng = random.Random(7)
    words = lambda n: [rng.randrange(3, 250) for _ in range(n)]   # noqa: E731
    prompts, outputs, hits = [], [], []
    try:
        prompt = words(21)                                # 2 full blocks: a snapshot at 16
        for _ in range(3):                                # three turns of one conversation
            tokens, hit = _one(llm, prompt)
            prompts.append(prompt)
            outputs.append(tokens)
            hits.append(hit)
            prompt = prompt + tokens + words(5)
        system = words(16)                                # two blocks exactly
        for _ in range(3):
            prompt = system + words(11)
            tokens, hit = _one(llm, prompt)
            prompts.append(prompt)
            outputs.append(tokens)
            hits.append(hit)
        llm.engine.block_manager.check_invariants()
        stats = llm.engine.block_manager.stats()
    finally:
        llm.shutdown()
    assert outputs == hf_greedy_each(path, prompts, NEW)
    # Turn 1 (21 tokens) snapshots at 16 (its prompt's last full block) and, decoding, at 32 (its output's last
    # block end: 21 + 11 computed tokens). Turn 2 (21 + 12 + 5 = 38 tokens) resumes at 32, and its output ends a
    # block at 48; turn 3 (55 tokens) resumes there. Under async scheduling a decode's block is not hashed yet when
    # it is scheduled (its token is pending), so only the prompts snapshot: turn 2 resumes at 16, turn 3 at 32
    # (where turn 2's prompt left turn 1's cached blocks: its branch snapshot). The system prompt: no hit, no hit
    # (KV cached, no state there: it snapshots at 16), then 16.
    assert hits == ([0, 16, 32] if async_scheduling else [0, 32, 48]) + [0, 0, 16]
    assert stats.num_free_state_slots == stats.num_state_slots

