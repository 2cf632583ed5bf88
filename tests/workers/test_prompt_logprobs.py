"""Prompt logprobs (``SamplingParams.prompt_logprobs``) against transformers' log-softmax of the same
prompt: over chunked prefill, sliced LM-head passes, a prefix that is already cached, ``n > 1`` forks
and preemptions; and the wire and validation around them."""

from __future__ import annotations

import pytest
import torch
from pagedray.block_manager import BlockManager
from pagedray.cluster import LLM, SamplingParams
from pagedray.workers.contract.wire import PromptLogprobs, StepResult, decode_result, encode_result
from pagedray.workers.runner import prompt_logprobs as prompt_module

PROMPT = [(11 * i) % 240 + 3 for i in range(45)]


def hf_prompt_logprobs(path: str, prompt: list[int]) -> torch.Tensor:
    """transformers' log_softmax at every prompt position: [len(prompt), vocab] (row p predicts p + 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)


def assert_matches_hf(entries, prompt: list[int], reference: torch.Tensor, k: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i, entry in enumerate(entries[1:], start=1):
        row = reference[i - 1]                                       # [vocab]
        assert entry.token_id == prompt[i]
        assert entry.logprob == pytest.approx(row[prompt[i]].item(), abs=1e-4)
        assert entry.rank == 1 + int((row > row[prompt[i]]).sum())
        values, ids = row.topk(k)
        assert [t for t, _ in entry.top_logprobs] == ids.tolist()
        assert [lp for _, lp in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)


def _llm(path: str, **kwargs) -> LLM:
    options = dict(dtype="float32", block_size=8, num_blocks=64, threads_per_worker=1, max_num_batched_tokens=16)
    return LLM(path, **{**options, **kwargs})


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_prompt_logprobs_match_transformers_over_chunks_and_slices(kind, tiny_model_path, monkeypatch):
    monkeypatch.setattr(prompt_module, "SLICE_ROWS", 5)   # several LM-head slices per 16-token chunk
    path = tiny_model_path(kind)
    with _llm(path) as llm:
        result, = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3),
                               use_tqdm=False)
    assert_matches_hf(result.prompt_logprobs, PROMPT, hf_prompt_logprobs(path, PROMPT), 3)


def test_cached_prefix_is_recomputed_for_prompt_logprobs_and_n_samples_share_them(tiny_model_path):
    path = tiny_model_path("llama")
    reference = hf_prompt_logprobs(path, PROMPT)
    with _llm(path) as llm:
        plain, = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        assert plain.prompt_logprobs is None
        again, = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        assert again.num_cached_prompt_tokens > 0                    # the prompt's blocks are cached
        asked, = llm.generate([PROMPT], SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=4,
                                                       prompt_logprobs=0), use_tqdm=False)
    assert asked.num_cached_prompt_tokens == 0                       # not read from the cache
    assert len(asked.outputs) == 3
    assert all(entry.top_logprobs == [] for entry in asked.prompt_logprobs[1:])   # k = 0
    assert_matches_hf(asked.prompt_logprobs, PROMPT, reference, 0)


def test_prompt_logprobs_survive_preemption(tiny_model_path):
    path = tiny_model_path("llama")
    prompts = [PROMPT[i:i + 20] for i in range(0, 25, 5)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=1)
    with _llm(path, num_blocks=16, watermark=0.0, max_num_seqs=5) as llm:
        results = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.stats().num_preemptions_total > 0
        assert llm.engine.block_manager.num_free_blocks == 16
    for prompt, result in zip(prompts, results):
        assert_matches_hf(result.prompt_logprobs, prompt, hf_prompt_logprobs(path, prompt), 1)


def test_block_manager_registers_without_the_cache_on_request():
    bm = BlockManager(block_size=4, num_blocks=16)
    tokens = list(range(13))
    bm.allocate_slots("a", tokens, 13)
    assert bm.num_cached_prefix_tokens(tokens) == 12
    assert bm.can_allocate("b", tokens, 13, reuse_cached=False)
    allocation = bm.allocate_slots("b", tokens, 13, reuse_cached=False)
    assert allocation.num_cached_tokens == 0 and len(allocation.new_block_ids) == 4
    assert bm.num_free_blocks == 16 - 8
    hit = bm.allocate_slots("c", tokens, 1)           # the others still find the cached prefix
    assert hit.num_cached_tokens == 12


def test_step_result_with_prompt_logprobs_round_trips_the_wire():
    tops = [[(5, -0.1), (8, -0.5)], [(1, -0.2), (4, -1.0)]]
    result = StepResult(7, [], [PromptLogprobs(3, 1, [-0.5, -1.25], [2, 9], tops),
                               PromptLogprobs(4, 6, [-2.0], [1], None)])
    assert decode_result(encode_result(result)) == result


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_sampling_params_names_a_bad_prompt_logprobs(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
