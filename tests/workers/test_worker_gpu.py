"""The worker on CUDA (``-m gpu``; skipped without a GPU): the model, the Triton kernels inside it and
the sampler on the device, against transformers on CPU.

* fp32 on CUDA: greedy tokens equal transformers' fp32 CPU ``generate`` token for token (tiny random
  models with well separated logits, batched, chunked prefill; the kernels use IEEE fp32 products and
  torch's fp32 matmuls do not use TF32 by default).
* bf16 on CUDA (the GPU default): the first greedy token of every prompt equals fp32 transformers',
  and the KV-cache size comes from the memory profile (``num_blocks`` unset), which must leave room for
  the whole batch.
* CUDA-graph decode (the default on CUDA): the graphs are captured at start-up, decode steps replay
  them (padded to their bucket), and the tokens equal the eager engine's (``enforce_eager``) in fp32
  and bf16, across bucket boundaries, with preemptions and prefix-cache hits in the run.
* A hybrid model's prefix cache (Qwen3.5: state snapshots, the Triton delta rule split at them): transformers'
  tokens and the expected hits (helpers/hybrid_runs.py).
"""

from __future__ import annotations

import dataclasses

import pytest
from helpers.hf_oracle import hf_greedy_each
from helpers.hybrid_runs import conversation_and_system_prompt, hybrid_llm
from helpers.worker_plans import PlanDriver, log_bucket_runs
from helpers.worker_setup import engine_config
from pagedray.cluster import LLM, SamplingParams
from pagedray.workers.worker import Worker

pytestmark = pytest.mark.gpu
NEW_TOKENS = 32
TINY_PROMPTS = [[5, 17, 33, 8, 99, 120, 7], list(range(3, 40)), [200, 201, 4], list(range(60, 80))]


def _cuda_driver(path: str, dtype: str, profile_memory: bool = False, enforce_eager: bool = False,
                 kv_cache_dtype: str = "auto", device: str = "cuda") -> tuple[Worker, PlanDriver]:
    config = engine_config(path, device=device, dtype=dtype, enforce_eager=enforce_eager,
                           kv_cache_dtype=kv_cache_dtype)
    if profile_memory:
        config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, num_blocks=None,
                                                                        gpu_memory_utilization=0.3))
    worker = Worker(config)
    num_blocks = worker.available_kv_blocks()
    worker.init_kv_cache(num_blocks)
    driver = PlanDriver(worker.execute, config.cache.block_size, num_blocks, token_budget=24, max_chunk=16)
    return worker, driver


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen3-moe",
                                  "qwen2-moe", "mixtral", "gpt-oss", "qwen3.5", "qwen3.5-moe", "gemma4", "gemma4-moe",
                                  "gemma4-wide"])
def test_fp32_on_cuda_matches_transformers(kind, tiny_model_path):
    path = tiny_model_path(kind)
    worker, driver = _cuda_driver(path, "float32")
    assert worker.device.type == "cuda"
    assert driver.generate(TINY_PROMPTS, NEW_TOKENS) == hf_greedy_each(path, TINY_PROMPTS, NEW_TOKENS)
    assert worker.num_sequences() == 0


def test_hybrid_prefix_hits_on_cuda_resume_from_state_snapshots(tiny_model_path):
    """Qwen3.5 through the engine on CUDA with prefix caching: snapshots taken inside prefill steps (the Triton delta
    rule in phases between cuts) and copied into seats at hits; transformers' tokens and each hit to the token."""
    path = tiny_model_path("qwen3.5")
    conversation_and_system_prompt(path, hybrid_llm(path, device="cuda"))


def test_gpt_oss_mxfp4_experts_stay_4_bit_on_cuda_and_match_transformers(tmp_path):
    """An MXFP4 gpt-oss on CUDA keeps its experts as float4 packed experts (the packed grouped GEMM with the
    clamped SwiGLU; CUDA graphs included): fp32 greedy tokens equal transformers' on its dequantized weights."""
    from helpers.mxfp4_checkpoints import mxfp4_checkpoint

    packed, plain = mxfp4_checkpoint(tmp_path)
    worker, driver = _cuda_driver(packed, "float32")
    moes = [layer.mlp for layer in worker.model.layers]
    assert all(moe.packed is not None and moe.packed[0].float4 for moe in moes) and worker.uses_decode_graphs
    assert driver.generate(TINY_PROMPTS, NEW_TOKENS) == hf_greedy_each(plain, TINY_PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_8bit_kv_cache_on_cuda_gives_the_cpu_engines_tokens(kv_cache_dtype, tiny_model_path):
    """fp32 with an 8-bit KV cache: the Triton store / decode / prefill (CUDA graphs included) give the
    same greedy tokens as the CPU engine with the same cache dtype (torch quantizer, C decode kernel)."""
    path = tiny_model_path("llama")
    _, cuda = _cuda_driver(path, "float32", kv_cache_dtype=kv_cache_dtype)
    _, cpu = _cuda_driver(path, "float32", kv_cache_dtype=kv_cache_dtype, device="cpu")
    assert cuda.generate(TINY_PROMPTS, NEW_TOKENS) == cpu.generate(TINY_PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("fmt, options", [("gptq", dict(group=16, desc_act=True, v2=False)), ("awq", dict(group=16)),
                                          ("fp8", dict(block=32)), ("fp8", dict(compressed_tensors=True))])
def test_packed_quantized_weights_on_cuda_match_transformers(fmt, options, tiny_model_path, tmp_path):
    """GPTQ / AWQ / FP8 on CUDA stay packed (kernels.quant_gemm's Triton GEMM; CUDA graphs included): fp32
    greedy tokens equal transformers' on the dequantized weights."""
    from helpers.quantized_checkpoints import quantize_folder

    quantize_folder(tiny_model_path("llama"), tmp_path / "q", tmp_path / "dq", fmt, **options)
    worker, driver = _cuda_driver(str(tmp_path / "q"), "float32")
    assert all(m.weight is None for m in worker.model.modules() if getattr(m, "quant", None) is not None)
    assert driver.generate(TINY_PROMPTS, NEW_TOKENS) == hf_greedy_each(str(tmp_path / "dq"), TINY_PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("fmt, options", [("awq", dict(group=16)), ("fp8", dict(block=16))])
def test_packed_moe_experts_on_cuda_match_transformers(fmt, options, tiny_model_path, tmp_path):
    """A quantized Qwen3-MoE on CUDA keeps its experts packed (the packed fused-MoE kernel; CUDA graphs
    included): fp32 greedy tokens equal transformers' on the dequantized weights."""
    from helpers.quantized_checkpoints import quantize_folder
    from pagedray.workers.layers.moe import SparseMoE

    quantize_folder(tiny_model_path("qwen3-moe"), tmp_path / "q", tmp_path / "dq", fmt, **options)
    worker, driver = _cuda_driver(str(tmp_path / "q"), "float32")
    assert all(m.packed is not None for m in worker.model.modules() if isinstance(m, SparseMoE))
    assert driver.generate(TINY_PROMPTS, NEW_TOKENS) == hf_greedy_each(str(tmp_path / "dq"), TINY_PROMPTS, NEW_TOKENS)


def test_bf16_on_cuda_with_profiled_kv_cache(tiny_model_path):
    path = tiny_model_path("llama")
    worker, driver = _cuda_driver(path, "bfloat16", profile_memory=True)
    assert driver.block_manager.num_free_blocks >= len(TINY_PROMPTS) * 16
    outputs = driver.generate(TINY_PROMPTS, 4)
    expected = hf_greedy_each(path, TINY_PROMPTS, 4)
    assert [out[0] for out in outputs] == [ref[0] for ref in expected]
    assert worker.num_sequences() == 0


GRAPH_PROMPTS = TINY_PROMPTS + [[9, 8, 7, 6, 5, 4, 3, 2], [150, 3, 77, 21, 18]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen3.5", "qwen3.5-moe", "gpt-oss", "gemma4",
                                  "gemma4-moe"])
def test_graph_replay_matches_eager(kind, dtype, tiny_model_path):
    path = tiny_model_path(kind)
    worker, driver = _cuda_driver(path, dtype)
    assert worker.uses_decode_graphs and worker.graph_report is not None
    graphs = worker.runner.decode_graphs
    assert set(graphs.graphs) == set(graphs.buckets)
    buckets_run = log_bucket_runs(graphs)
    replayed = driver.generate(GRAPH_PROMPTS, NEW_TOKENS)
    _, eager_driver = _cuda_driver(path, dtype, enforce_eager=True)
    assert replayed == eager_driver.generate(GRAPH_PROMPTS, NEW_TOKENS)
    assert (5, 8) in buckets_run and (3, 4) in buckets_run      # padded rows across bucket boundaries
    if dtype == "float32":
        assert replayed == hf_greedy_each(path, GRAPH_PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_with_preemption_and_prefix_hits_match_eager(dtype, tiny_model_path):
    path = tiny_model_path("qwen3")
    prompts = [[7, 8, 9, 10] * 4 + [i + 20, i + 40] for i in range(5)]     # a shared 16-token prefix
    params = SamplingParams(temperature=0, max_tokens=16)

    def generate(enforce_eager: bool):
        llm = LLM(path, device="cuda", dtype=dtype, block_size=8, num_blocks=16, watermark=0.0, max_num_seqs=8,
                  enforce_eager=enforce_eager)
        try:
            worker = llm.engine.executor.worker
            assert (worker.graph_report is None) == enforce_eager
            results = llm.generate(prompts, params, use_tqdm=False)
            return [r.outputs[0].token_ids for r in results], llm.engine.stats()
        finally:
            llm.shutdown()

    replayed, stats = generate(enforce_eager=False)
    eager, _ = generate(enforce_eager=True)
    assert replayed == eager
    assert stats.num_preemptions_total > 0 and stats.prefix_hit_rate > 0


@pytest.mark.parametrize("draft", [None, "qwen3", "llama"])
def test_speculative_decoding_on_cuda_matches_transformers(draft, tiny_model_path):
    """n-gram drafts (None) and a draft model on the rank: another architecture with the same vocabulary
    (qwen3) or the target itself (llama: nearly every draft accepted), decode graphs on, fp32."""
    path = tiny_model_path("llama")
    prompts = TINY_PROMPTS + [[5, 6, 7, 8] * 4, [9, 10] * 6]
    options = {"speculative_model": tiny_model_path(draft)} if draft else {}
    llm = LLM(path, device="cuda", dtype="float32", block_size=8, num_blocks=48, max_num_seqs=8,
              num_speculative_tokens=3, **options)
    try:
        results = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                               use_tqdm=False)
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    assert [r.outputs[0].token_ids for r in results] == hf_greedy_each(path, prompts, NEW_TOKENS)
    assert stats.spec_decode_num_draft_tokens_total > 0
    if draft == "llama":
        assert stats.spec_decode_num_accepted_tokens_total > 0.9 * stats.spec_decode_num_draft_tokens_total
