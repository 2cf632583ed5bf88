"""Fixtures for the worker tests: tiny random models saved as HF folders, the HF greedy oracle, workers.

Tiny models are built with transformers from a config, initialised from a fixed seed with a larger
``initializer_range`` than the default (so logits are well separated and greedy decoding is not
decided by float noise), and saved with ``save_pretrained`` (safetensors).
"""

from __future__ import annotations

import pytest
import torch
from pagedray.workers.contract.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagedray.workers.worker import Worker
from worker_plans import PlanDriver

TINY_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=251,
                   max_position_embeddings=512, initializer_range=0.25, rms_norm_eps=1e-6,
                   bos_token_id=1, eos_token_id=2)


def tiny_config(kind: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if kind == "llama":   # llama3 rope scaling, GQA 4:2, untied LM head, odd vocab (uneven TP split)
        return LlamaConfig(**TINY_COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                           architectures=["LlamaForCausalLM"])
    if kind == "mistral":  # sliding_window (4096) longer than the context (512): plain causal attention
        return MistralConfig(**TINY_COMMON, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                             architectures=["MistralForCausalLM"])
    if kind == "mistral-window":  # an 8-token sliding window: every prompt and generation runs past it
        return MistralConfig(**TINY_COMMON, num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                             architectures=["MistralForCausalLM"])
    if kind == "qwen2":   # qkv bias, tied embeddings
        return Qwen2Config(**TINY_COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                           architectures=["Qwen2ForCausalLM"])
    if kind == "qwen3":   # q/k norm, explicit head_dim != hidden / heads, a single KV head (replicated at TP=2)
        return Qwen3Config(**TINY_COMMON, num_attention_heads=4, num_key_value_heads=1, head_dim=24,
                           tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"])
    raise ValueError(kind)


def save_tiny_model(kind: str, folder, max_shard_size: str | None = None) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(tiny_config(kind), dtype=torch.float32)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(folder), **kwargs)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """kind -> saved folder (built once per session)."""
    paths: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in paths:
            paths[kind] = save_tiny_model(kind, tmp_path_factory.mktemp(f"tiny-{kind}"))
        return paths[kind]

    return get


def hf_greedy(model_path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers generate(do_sample=False), fp32 CPU, one prompt at a time (no padding), EOS ignored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
            assert len(outputs[-1]) == max_new_tokens, "HF stopped early"

    return outputs


def hf_logprobs_along(model_path: str, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of transformers' next-token logits before each output token: [len(output), vocab] fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1:]
    return torch.log_softmax(logits.float(), dim=-1)


def engine_config(model_path: str, tp: int = 1, num_blocks: int = 64, block_size: int = 8,
                  **model_kwargs) -> EngineConfig:
    return EngineConfig(model=ModelConfig(**{"dtype": "float32", "model": model_path, **model_kwargs}),
                        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
                        parallel=ParallelConfig(tensor_parallel_size=tp, executor="ray" if tp > 1 else "local",
                                                threads_per_worker=1),
                        scheduler=SchedulerConfig(max_num_batched_tokens=256))


def local_driver(model_path: str, num_blocks: int = 64, block_size: int = 8, token_budget: int = 24,
                 max_chunk: int = 16, enable_prefix_caching: bool = False) -> tuple[Worker, PlanDriver]:
    worker = Worker(engine_config(model_path, num_blocks=num_blocks, block_size=block_size))
    worker.init_kv_cache(worker.available_kv_blocks())
    driver = PlanDriver(worker.execute, block_size, num_blocks, token_budget=token_budget, max_chunk=max_chunk,
                        enable_prefix_caching=enable_prefix_caching)
    return worker, driver


def start_ray_workers(ray, model_path: str, tp: int, num_blocks: int = 64, block_size: int = 8):
    """tp RayWorker actors joined into one gloo group, KV caches allocated; returns the actor list."""
    from pagedray.workers.ray_worker import RayWorker

    config = engine_config(model_path, tp=tp, num_blocks=num_blocks, block_size=block_size)
    actors = [RayWorker.options(num_cpus=1).remote(config, rank) for rank in range(tp)]
    ip, port = ray.get(actors[0].node_ip_and_free_port.remote())
    ray.get([a.init_worker.remote(f"tcp://{ip}:{port}") for a in actors])
    blocks = min(ray.get([a.available_kv_blocks.remote() for a in actors]))
    ray.get([a.init_kv_cache.remote(blocks) for a in actors])
    return actors


def ray_execute(ray, actors):
    """plan -> StepResult through execute_bytes on every rank (msgpack wire form); only rank 0 answers."""
    from pagedray.workers.contract.wire import decode_result, encode_plan

    def execute(plan):
        data = encode_plan(plan)
        replies = ray.get([a.execute_bytes.remote(data) for a in actors])
        assert all(r is None for r in replies[1:]), "only rank 0 may return a result"
        return decode_result(replies[0])

    return execute


def stop_ray_workers(ray, actors) -> None:
    ray.get([a.shutdown.remote() for a in actors])
    for actor in actors:
        ray.kill(actor)
