"""Every family added for #36 and #67, end to end through the engine (``LLM``, in process, fp32): greedy tokens
equal transformers' ``generate`` for 32 new tokens (EOS ignored), for both samples of n=2 (forked sequences
sharing the prompt's blocks), in a run that has everything at once: prompts
sharing a prefix (prefix-cache hits), a KV pool too small for all of them (preemption and recompute), a
small token budget (chunked prefill, steps mixing prefill chunks with decode tokens). Hybrid models (Qwen3.5)
hit the prefix cache through its state snapshots (cluster/hybrid.py), and every seat is free at the end."""

from __future__ import annotations

import math
import random

import pytest
from helpers.hf_oracle import hf_greedy_each
from pagedray.cluster import LLM, SamplingParams

BLOCK, NEW = 8, 32


@pytest.mark.parametrize("kind", ["qwen2-window", "phi3", "phi3-longrope", "gemma2", "gemma3", "qwen3-moe",
                                  "qwen2-moe", "mixtral", "gpt-oss", "qwen3.5", "qwen3.5-moe", "gemma4",
                                  "gemma4-moe"])
def test_prefix_hits_preemption_and_chunks_match_transformers(kind, tiny_model_path):
    path = tiny_model_path(kind)
    rng = random.Random(kind)
    prefix = [rng.randrange(3, 250) for _ in range(3 * BLOCK)]
    prompts = [prefix + [rng.randrange(3, 250) for _ in range(rng.randrange(3, 20))] for _ in range(5)]
    demand = sum(math.ceil((len(p) + NEW) / BLOCK) for p in prompts)
    llm = LLM(path, dtype="float32", block_size=BLOCK, num_blocks=max(demand // 3, 16), watermark=0.0,
              threads_per_worker=1, max_num_batched_tokens=24, enable_prefix_caching=True)
    try:
        results = llm.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=NEW, ignore_eos=True),
                               use_tqdm=False)
        stats = llm.engine.stats()
        hybrid = llm.engine.model_info.hybrid
        llm.engine.block_manager.check_invariants()
        states = llm.engine.block_manager.stats()
    finally:
        llm.shutdown()
    want = hf_greedy_each(path, prompts, NEW)
    assert [[o.token_ids for o in r.outputs] for r in results] == [[w, w] for w in want]   # n=2: forked samples
    assert stats.num_preemptions_total > 0 and stats.prefix_hit_tokens_total > 0
    if hybrid:   # every seat came back
        assert states.num_free_state_slots == states.num_state_slots > 0
    else:
        assert states.num_state_slots == 0
