"""The default SmolLM2-135M-Instruct through LLM (text in, text out) equals HF generate(do_sample=False)."""

import torch
from conftest import hf_greedy
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
