"""What the engine tells the ingress about itself (``ServedEngine.model_meta``): the scheduler's
``max_num_seqs`` travels with it, and the ingress bounds a batch request's sequences in flight by half
of it (service.py) instead of a constant."""

from __future__ import annotations

import asyncio

from helpers.tiny_models import save_tiny_llama
from pagedray.deploy.serve.served_engine import ServedEngine
from pagedray.workers.contract.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig


def test_model_meta_carries_the_configured_max_num_seqs(tmp_path):
    path = save_tiny_llama(tmp_path / "tiny")
    config = EngineConfig(model=ModelConfig(model=path, dtype="float32"), cache=CacheConfig(num_blocks=32),
                          parallel=ParallelConfig(executor="local", threads_per_worker=1),
                          scheduler=SchedulerConfig(max_num_seqs=6))
    served = ServedEngine(config)
    try:
        meta = served.model_meta()
        assert (meta.max_num_seqs, meta.vocab_size, meta.dtype) == (6, 512, "float32")
    finally:
        asyncio.run(served.close())
