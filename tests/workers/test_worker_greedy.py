"""Greedy tokens of the Worker == transformers generate(do_sample=False), fp32 CPU, token for token.

Every run is batched (prompts of different lengths admitted one per step), uses chunked prefill
(``max_chunk`` smaller than the longer prompts) and a per-step token budget, so steps mix prefill
chunks with decode tokens; ``_assert_mixed`` checks that the plans really did.
"""

from __future__ import annotations

import pytest
from helpers.hf_oracle import hf_greedy_each
from helpers.tiny_models import save_tiny_model
from helpers.worker_setup import local_driver

NEW_TOKENS = 64
TINY_PROMPTS = [[5, 17, 33, 8, 99, 120, 7], list(range(3, 40)), [200, 201, 4], list(range(60, 80))]


def _assert_mixed(plans) -> None:
    """Some step carried a multi-token prefill chunk next to a decode token, and some prompt was chunked."""
    mixed = any(any(r.num_scheduled_tokens == 1 for r in p.running)
                and any(n.num_scheduled_tokens > 1 for n in p.new_seqs) for p in plans)
    chunked = any(n.num_scheduled_tokens < len(n.prompt_token_ids) for p in plans for n in p.new_seqs)
    assert mixed and chunked


@pytest.mark.parametrize("kind", ["llama", "mistral", "mistral-window", "qwen2", "qwen2-window", "qwen3",
                                  "qwen3-window", "phi3", "phi3-longrope", "gemma2", "gemma3", "qwen3-moe", "qwen2-moe",
                                  "mixtral", "gpt-oss", "qwen3.5", "qwen3.5-moe", "qwen3.5-vl", "gemma4", "gemma4-moe",
                                  "gemma4-vl", "gemma4-wide"])
def test_tiny_models_match_transformers(kind, tiny_model_path):
    path = tiny_model_path(kind)
    worker, driver = local_driver(path, token_budget=24, max_chunk=16)
    outputs = driver.generate(TINY_PROMPTS, NEW_TOKENS)
    assert outputs == hf_greedy_each(path, TINY_PROMPTS, NEW_TOKENS)
    _assert_mixed(driver.plans)
    assert worker.num_sequences() == 0  # every finished sequence was released


@pytest.mark.parametrize("kind", ["qwen2-untied", "gemma2-untied", "gemma3-untied", "gemma4-untied"])
def test_untied_lm_head_is_read(kind, tiny_model_path):
    """Families whose configs tie by default, saved with their own LM head: the head is read, not the
    embedding reused (every other family's tiny config is already untied)."""
    from safetensors import safe_open

    path = tiny_model_path(kind)
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        assert not f.get_tensor("lm_head.weight").equal(f.get_tensor("model.embed_tokens.weight"))
    _, driver = local_driver(path, token_budget=24, max_chunk=16)
    assert driver.generate(TINY_PROMPTS, NEW_TOKENS) == hf_greedy_each(path, TINY_PROMPTS, NEW_TOKENS)


def test_index_sharded_checkpoint(tmp_path):
    path = save_tiny_model("llama", tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    prompts = TINY_PROMPTS[:2]
    _, driver = local_driver(path)
    assert driver.generate(prompts, NEW_TOKENS) == hf_greedy_each(path, prompts, NEW_TOKENS)


def test_smollm2_plain_and_chat_prompts(default_model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    plain = [tokenizer("The capital of France is")["input_ids"]]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}],
                                         add_generation_prompt=True, tokenize=True, return_dict=True)
    prompts = plain + [list(chat["input_ids"])]
    assert len(prompts[0]) < 24 < len(prompts[1])   # the chat prompt is prefilled in two chunks
    _, driver = local_driver(default_model_path, num_blocks=32, block_size=16, token_budget=32, max_chunk=24)
    outputs = driver.generate(prompts, NEW_TOKENS)
    assert outputs == hf_greedy_each(default_model_path, prompts, NEW_TOKENS)
    _assert_mixed(driver.plans)
