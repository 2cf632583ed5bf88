"""Fixtures of the cluster tests: a tiny random Llama folder (fast breadth) and HF greedy references.

The tiny model has a 512-token vocabulary and weights drawn with a large std so that greedy logits
have clear margins (no near-ties that summation order could flip). EOS is token 1.
"""

import pytest
import torch

TINY_EOS = 1


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.3, bos_token_id=0, eos_token_id=TINY_EOS,
                         tie_word_embeddings=False)
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(path)
    GenerationConfig(bos_token_id=0, eos_token_id=TINY_EOS).save_pretrained(path)
    return str(path)


def hf_greedy(model, prompt_ids, max_new_tokens, eos_ids):
    """HF generate(do_sample=False), cut after the first EOS (the engine stops there too)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                             dtype=torch.long), do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=list(eos_ids), pad_token_id=0)
    tokens = out[0, len(prompt_ids):].tolist()
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[:i + 1]
    return tokens


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_llama_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
