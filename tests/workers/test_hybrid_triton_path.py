"""Qwen3.5's linear-attention layers through the Triton gated delta rule (the CUDA path: one launch per step over
every sequence, states read and written in the pool in place), run here under the interpreter: greedy tokens
still equal transformers' with chunked prefill and mixed steps (a GPU runs the same in
tests/workers/test_worker_gpu.py)."""

from __future__ import annotations

from helpers.hf_oracle import hf_greedy_each
from helpers.worker_setup import local_driver

PROMPTS = [[5, 17, 33, 8, 99, 120, 7], list(range(3, 40)), [200, 201, 4]]


def test_the_triton_delta_rule_gives_transformers_tokens(tiny_model_path):
    path = tiny_model_path("qwen3.5")
    worker, driver = local_driver(path, token_budget=24, max_chunk=16)
    layers = [layer.linear_attn for layer in worker.model.layers if layer.kind == "linear_attention"]
    assert layers and not any(layer.use_triton for layer in layers)      # CPU tensors: the torch path by default
    for layer in layers:
        layer.use_triton = True
    assert driver.generate(PROMPTS, 32) == hf_greedy_each(path, PROMPTS, 32)
