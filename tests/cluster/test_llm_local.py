"""End to end through LLM + LocalExecutor (fp32, CPU): greedy tokens equal HF generate token for token,
with plenty of KV, with a KV pool at ~25% of the demand (preemptions), with a small token budget
(chunked prefill), with prefix caching on and off, and n > 1; each with the synchronous engine and
with async scheduling (``async_scheduling``: step N+1 scheduled while step N runs on the
executor's thread)."""

import math
import random

import pytest
from helpers.hf_oracle import hf_greedy
from pagedray.cluster import LLM, SamplingParams

BLOCK = 8
MAX_TOKENS = 20


def _prompts(seed=0, count=6, shared_prefix=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(2, 512) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(2, 512) for _ in range(rng.randrange(5, 40))] for _ in range(count)]


@pytest.fixture(params=[False, True], ids=["sync", "async_scheduling"])
def async_scheduling(request):
    return request.param


@pytest.fixture(scope="module")
def references(tiny_hf_model):
    cache = {}

    def ref(prompt):
        key = tuple(prompt)
        if key not in cache:
            cache[key] = hf_greedy(tiny_hf_model, prompt, MAX_TOKENS, {1})
        return cache[key]
    return ref


def _run(path, prompts, async_scheduling, **kwargs):
    llm = LLM(path, dtype="float32", block_size=BLOCK, watermark=0.0, threads_per_worker=1,
              async_scheduling=async_scheduling, **kwargs)
    try:
        results = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
        return results, llm.engine.stats()
    finally:
        llm.shutdown()


def _assert_matches(results, prompts, references):
    for result, prompt in zip(results, prompts):
        expected = references(prompt)
        (out,) = result.outputs
        assert out.token_ids == expected, f"prompt {prompt[:5]}..."
        assert out.finish_reason == ("stop" if expected[-1] == 1 else "length")


def test_plenty_of_kv_matches_hf(tiny_llama_path, references, async_scheduling):
    prompts = _prompts()
    results, stats = _run(tiny_llama_path, prompts, async_scheduling, num_blocks=256)
    _assert_matches(results, prompts, references)
    assert stats.num_preemptions_total == 0 and stats.kv_usage == 0.0


def test_kv_pool_at_a_quarter_of_demand_preempts_and_still_matches(tiny_llama_path, references, async_scheduling):
    prompts = _prompts(seed=1, count=8)
    demand_blocks = sum(math.ceil((len(p) + MAX_TOKENS) / BLOCK) for p in prompts)
    num_blocks = max(math.ceil(demand_blocks / 4), math.ceil((max(map(len, prompts)) + MAX_TOKENS) / BLOCK))
    results, stats = _run(tiny_llama_path, prompts, async_scheduling, num_blocks=num_blocks)
    _assert_matches(results, prompts, references)
    assert stats.num_preemptions_total > 0


def test_small_token_budget_chunks_prefill_and_matches(tiny_llama_path, references, async_scheduling):
    prompts = _prompts(seed=2)
    assert max(map(len, prompts)) > 8
    results, stats = _run(tiny_llama_path, prompts, async_scheduling, num_blocks=256, max_num_batched_tokens=8)
    _assert_matches(results, prompts, references)
    assert stats.num_steps_total >= sum(len(p) for p in prompts) // 8


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_caching_on_and_off_match(tiny_llama_path, references, caching, async_scheduling):
    prompts = _prompts(seed=3, count=5, shared_prefix=3 * BLOCK)
    llm = LLM(tiny_llama_path, dtype="float32", block_size=BLOCK, num_blocks=256, enable_prefix_caching=caching,
              threads_per_worker=1, async_scheduling=async_scheduling)
    try:
        first = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
        rest = llm.generate(prompts[1:], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
        hit_tokens = llm.engine.stats().prefix_hit_tokens_total
    finally:
        llm.shutdown()
    _assert_matches(first + rest, prompts, references)
    assert hit_tokens == (4 * 3 * BLOCK if caching else 0)
    assert [r.num_cached_prompt_tokens for r in rest] == [3 * BLOCK if caching else 0] * 4


def test_n_samples_fork_and_each_matches_hf(tiny_llama_path, references, async_scheduling):
    prompts = _prompts(seed=4, count=2)
    llm = LLM(tiny_llama_path, dtype="float32", block_size=BLOCK, num_blocks=256, threads_per_worker=1,
              async_scheduling=async_scheduling)
    try:
        results = llm.generate(prompts, SamplingParams(n=3, temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    finally:
        llm.shutdown()
    for result, prompt in zip(results, prompts):
        assert [o.token_ids for o in result.outputs] == [references(prompt)] * 3
        assert [o.index for o in result.outputs] == [0, 1, 2]


def test_seeded_n_samples_differ_and_reproduce(tiny_llama_path, async_scheduling):
    """n > 1 with a seed: each choice samples with seed + index, so the choices differ and a rerun
    (alone, or next to other requests) gives the same choices."""
    prompt = _prompts(seed=5, count=1)[0]
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=MAX_TOKENS)
    llm = LLM(tiny_llama_path, dtype="float32", block_size=BLOCK, threads_per_worker=1,
              async_scheduling=async_scheduling)
    try:
        first = llm.generate([prompt], params, use_tqdm=False)[0]
        again = llm.generate([_prompts(seed=6, count=1)[0], prompt], params, use_tqdm=False)[1]
        choice_2 = llm.generate([prompt], SamplingParams(temperature=1.0, seed=13, max_tokens=MAX_TOKENS),
                                use_tqdm=False)[0]
    finally:
        llm.shutdown()
    samples = [tuple(o.token_ids) for o in sorted(first.outputs, key=lambda o: o.index)]
    assert len(set(samples)) == 4, samples
    assert [tuple(o.token_ids) for o in sorted(again.outputs, key=lambda o: o.index)] == samples
    assert tuple(choice_2.outputs[0].token_ids) == samples[2]   # choice i is the request with seed + i


def test_unknown_engine_argument_is_rejected(tiny_llama_path):
    with pytest.raises(ValueError, match="max_num_seq: not a known engine setting"):
        LLM(tiny_llama_path, max_num_seq=4)
