"""The correctness oracle: Hugging Face transformers' greedy ``generate`` (fp32, CPU) and its log-probs."""

from __future__ import annotations

import torch


def load_hf_model(model_path: str):
    """The folder's model through transformers, fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos_ids=None) -> list[int]:
    """``generate(do_sample=False)`` for one prompt (no padding).

    ``eos_ids`` None: EOS is ignored and exactly ``max_new_tokens`` come back (asserted); else the
    output is cut after the first of ``eos_ids`` (the engine stops there too). The model's generation
    config is the same after the call."""
    saved_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None if eos_ids is None else list(eos_ids)
    ids = torch.tensor([prompt])
    try:
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0)
    finally:
        model.generation_config.eos_token_id = saved_eos
    tokens = out[0, len(prompt):].tolist()
    if eos_ids is None:
        assert len(tokens) == max_new_tokens, "HF stopped early"
        return tokens
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[:i + 1]
    return tokens


def hf_greedy_each(model_path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """``hf_greedy`` of each prompt, EOS ignored, with the folder's model loaded once."""
    model = load_hf_model(model_path)
    return [hf_greedy(model, prompt, max_new_tokens) for prompt in prompts]


def hf_logprobs_along(model_path: str, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of transformers' next-token logits before each output token: [len(output), vocab] fp32."""
    model = load_hf_model(model_path)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1:]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_top_logprobs_match(model_path: str, seqs, atol: float = 1e-4) -> None:
    """Every sampled token's top logprobs (``seq.sampled``) equal transformers' log-softmax at those ids."""
    for seq in seqs:
        reference = hf_logprobs_along(model_path, seq.prompt, seq.output)
        for row, sampled in zip(reference, seq.sampled):
            ids = [token for token, _ in sampled.top_logprobs]
            values = torch.tensor([value for _, value in sampled.top_logprobs])
            torch.testing.assert_close(values, row[ids], rtol=0, atol=atol)
