"""Shared by the speculative-decoding tests: prompts that repeat themselves, an engine run that checks
nothing leaked, and a small draft model folder."""

from __future__ import annotations

import torch
from pagedray.cluster import LLM

REPEATING = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [40, 41, 42, 43, 44, 45, 40, 41, 42, 43, 44, 45, 40, 41],
             [3, 3, 3, 3, 3, 3, 3, 3], [100 + (i % 7) for i in range(30)]]
ENGINE = dict(dtype="float32", block_size=8, num_blocks=128, threads_per_worker=1)


def generate(path, prompts, params, proposer=None, **engine):
    """(results, stats) of one engine run; asserts that every block and worker mirror was released."""
    with LLM(path, **{**ENGINE, **engine}) as llm:
        if proposer is not None:
            llm.engine.scheduler.proposer = proposer
        results = llm.generate(prompts, params, use_tqdm=False)
        bm, stats = llm.engine.block_manager, llm.engine.stats()
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks                   # no block outlives its request
        executor = llm.engine.executor
        mirrored = executor.num_sequences() if hasattr(executor, "num_sequences") else executor.worker.num_sequences()
        assert mirrored in (0, [0, 0])                               # every worker mirror released
    return results, stats


def tokens(results):
    return [[choice.token_ids for choice in r.outputs] for r in results]


def save_llama(folder, vocab_size: int, layers: int, seed: int, kv_heads: int = 1) -> str:
    """A small random Llama (hidden 32, 2 heads) saved to ``folder``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=kv_heads, max_position_embeddings=512,
                         initializer_range=0.3, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    return str(folder)
