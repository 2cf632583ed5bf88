"""The worker on CUDA (``-m gpu``; skipped without a GPU): the model, the Triton kernels inside it and
the sampler on the device, against transformers on CPU.

* fp32 on CUDA: greedy tokens equal transformers' fp32 CPU ``generate`` token for token (tiny random
  models with well separated logits, batched, chunked prefill; the kernels use IEEE fp32 products and
  torch's fp32 matmuls do not use TF32 by default).
* bf16 on CUDA (the GPU default): the first greedy token of every prompt equals fp32 transformers',
  and the KV-cache size comes from the memory profile (``num_blocks`` unset), which must leave room for
  the whole batch.
"""

from __future__ import annotations

import dataclasses

import pytest
from conftest import engine_config, hf_greedy
from pagedray.workers.worker import Worker
from worker_plans import PlanDriver

pytestmark = pytest.mark.gpu
NEW_TOKENS = 32
TINY_PROMPTS = [[5, 17, 33, 8, 99, 120, 7], list(range(3, 40)), [200, 201, 4], list(range(60, 80))]


def _cuda_driver(path: str, dtype: str, profile_memory: bool = False) -> tuple[Worker, PlanDriver]:
    config = engine_config(path, device="cuda", dtype=dtype)
    if profile_memory:
        config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, num_blocks=None,
                                                                        gpu_memory_utilization=0.3))
    worker = Worker(config)
    num_blocks = worker.available_kv_blocks()
    worker.init_kv_cache(num_blocks)
    driver = PlanDriver(worker.execute, config.cache.block_size, num_blocks, token_budget=24, max_chunk=16)
    return worker, driver


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3"])
def test_fp32_on_cuda_matches_transformers(kind, tiny_model_path):
    path = tiny_model_path(kind)
    worker, driver = _cuda_driver(path, "float32")
    assert worker.device.type == "cuda"
    assert driver.generate(TINY_PROMPTS, NEW_TOKENS) == hf_greedy(path, TINY_PROMPTS, NEW_TOKENS)
    assert worker.num_sequences() == 0


def test_bf16_on_cuda_with_profiled_kv_cache(tiny_model_path):
    path = tiny_model_path("llama")
    worker, driver = _cuda_driver(path, "bfloat16", profile_memory=True)
    assert driver.block_manager.num_free_blocks() >= len(TINY_PROMPTS) * 16
    outputs = driver.generate(TINY_PROMPTS, 4)
    expected = hf_greedy(path, TINY_PROMPTS, 4)
    assert [out[0] for out in outputs] == [ref[0] for ref in expected]
    assert worker.num_sequences() == 0
