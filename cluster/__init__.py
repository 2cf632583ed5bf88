"""pagedray.cluster: configs, requests, wire types, the scheduler, the engine (central actor body),
executors and the offline ``LLM`` API.

Heavy members (the engine imports the workers, and with them torch) are imported on first use, so
that importing the configs and ``SamplingParams`` from here stays light.
"""

from pagedray.workers.contract.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagedray.workers.contract.lora_request import LoRARequest
from pagedray.workers.contract.sampling_params import SamplingParams

__all__ = ["CacheConfig", "EngineConfig", "ModelConfig", "ParallelConfig", "SchedulerConfig",
           "SamplingParams", "LoRARequest", "LLM", "Engine", "AsyncEngine"]

_LAZY = {"LLM": ("llm", "LLM"), "Engine": ("engine", "Engine"), "AsyncEngine": ("async_engine", "AsyncEngine")}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f".{module}", __name__), attr)
    raise AttributeError(f"module 'pagedray.cluster' has no attribute {name!r}")
