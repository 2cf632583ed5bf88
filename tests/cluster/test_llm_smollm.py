"""The default SmolLM2-135M-Instruct through LLM (text in, text out) equals HF generate(do_sample=False)."""

import torch
from helpers.hf_oracle import hf_greedy
from pagedray.cluster import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def test_smollm2_text_prompts_match_hf_greedy(default_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    llm = LLM(default_model_path, dtype="float32", num_blocks=64, block_size=16, threads_per_worker=1)
    try:
        results = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    finally:
        llm.shutdown()
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    eos = set(llm.engine.model_info.eos_token_ids)
    for prompt, result in zip(PROMPTS, results):
        ids = tokenizer(prompt).input_ids
        assert result.prompt == prompt and result.prompt_token_ids == ids
        expected = hf_greedy(model, ids, 16, eos)
        assert result.outputs[0].token_ids == expected
        assert result.outputs[0].text == tokenizer.decode(expected, skip_special_tokens=True)
        assert result.outputs[0].text.strip()


def test_min_tokens_and_logit_bias_on_the_real_model(default_model_path):
    """Through the worker's sampler: a stop id banned by min_tokens gives HF's second-best first token;
    a +100 logit_bias makes greedy pick the biased token at every step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    ids = tokenizer(PROMPTS[0]).input_ids
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        first_best, first_second = model(torch.tensor([ids])).logits[0, -1].topk(2).indices.tolist()
    biased = tokenizer.encode(" banana")[0]
    llm = LLM(default_model_path, dtype="float32", num_blocks=64, block_size=16, threads_per_worker=1)
    try:
        banned, bias = llm.generate(
            [ids, ids], [SamplingParams(temperature=0, max_tokens=3, stop_token_ids=(first_best,), min_tokens=1),
                         SamplingParams(temperature=0, max_tokens=4, logit_bias=((biased, 100.0),))],
            use_tqdm=False)
    finally:
        llm.shutdown()
    assert banned.outputs[0].token_ids[0] == first_second
    assert bias.outputs[0].token_ids == [biased] * 4


def test_async_scheduling_on_the_real_model_matches_hf_greedy_and_the_synchronous_seeded_draws(default_model_path):
    """async_scheduling (step N+1 scheduled while step N runs) on SmolLM2 with a KV pool that preempts:
    greedy equals HF, and seeded samples equal the synchronous engine's (a draw depends only on the
    seed, the position and the logits)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    prompts = PROMPTS + ["Once upon a time", "1, 2, 3, 4,", "Hello, my name is"]
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=12) for i in range(len(prompts))]
    runs = {}
    for async_scheduling in (False, True):
        llm = LLM(default_model_path, dtype="float32", num_blocks=8, block_size=8, max_num_seqs=4,
                  max_num_batched_tokens=16, threads_per_worker=1, async_scheduling=async_scheduling)
        try:
            greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
            sampled = llm.generate(prompts, seeded, use_tqdm=False)
            preemptions = llm.engine.stats().num_preemptions_total
        finally:
            llm.shutdown()
        runs[async_scheduling] = ([r.outputs[0].token_ids for r in greedy], [r.outputs[0].token_ids for r in sampled])
        assert preemptions > 0
    assert runs[True] == runs[False]
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    eos = {tokenizer.eos_token_id}
    for prompt, tokens in zip(prompts, runs[True][0]):
        assert tokens == hf_greedy(model, tokenizer(prompt).input_ids, 12, eos)
