"""Workers over tiny model folders: the engine config the worker tests use, an in-process worker with a
plan driver, and TP groups of Ray worker actors."""

from __future__ import annotations

import dataclasses

from pagedray.workers.contract.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagedray.workers.worker import Worker

from helpers.worker_plans import PlanDriver


def engine_config(model_path: str, tp: int = 1, num_blocks: int = 64, block_size: int = 8,
                  kv_cache_dtype: str = "auto", **model_kwargs) -> EngineConfig:
    """``model_kwargs``: ModelConfig fields, and CacheConfig ones (kv_offload_gib, ...)."""
    cache_fields = {f.name for f in dataclasses.fields(CacheConfig)}
    cache_kwargs = {k: model_kwargs.pop(k) for k in list(model_kwargs) if k in cache_fields}
    return EngineConfig(model=ModelConfig(**{"dtype": "float32", "model": model_path, **model_kwargs}),
                        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype,
                                          **cache_kwargs),
                        parallel=ParallelConfig(tensor_parallel_size=tp, executor="ray" if tp > 1 else "local",
                                                threads_per_worker=1),
                        scheduler=SchedulerConfig(max_num_batched_tokens=256))


def local_driver(model_path: str, num_blocks: int = 64, block_size: int = 8, token_budget: int = 24,
                 max_chunk: int = 16, enable_prefix_caching: bool = False,
                 kv_cache_dtype: str = "auto", **model_kwargs) -> tuple[Worker, PlanDriver]:
    worker = Worker(engine_config(model_path, num_blocks=num_blocks, block_size=block_size,
                                  kv_cache_dtype=kv_cache_dtype, **model_kwargs))
    worker.init_kv_cache(worker.available_kv_blocks())
    # state slots only for a hybrid model: with them the block manager's prefix hits need state snapshots, which
    # this driver does not take (the engine's scheduler does: tests/cluster/test_hybrid_prefix_cache.py)
    slots = 16 if hasattr(worker.model, "allocate_states") else 0
    driver = PlanDriver(worker.execute, block_size, num_blocks, token_budget=token_budget, max_chunk=max_chunk,
                        enable_prefix_caching=enable_prefix_caching, num_state_slots=slots)
    return worker, driver


def start_ray_workers(ray, model_path: str, tp: int, num_blocks: int = 64, block_size: int = 8,
                      kv_cache_dtype: str = "auto", **model_kwargs):
    """tp RayWorker actors joined into one gloo group, KV caches allocated; returns the actor list."""
    from pagedray.workers.ray_worker import RayWorker

    config = engine_config(model_path, tp=tp, num_blocks=num_blocks, block_size=block_size,
                           kv_cache_dtype=kv_cache_dtype, **model_kwargs)
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
