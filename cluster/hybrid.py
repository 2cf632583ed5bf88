"""What a hybrid model (linear-attention layers with a per-sequence recurrent state: Qwen3.5 / 3.6) changes in an
engine's configuration, settled once before any rank starts.

- Prefix caching is switched off, with a log line saying so: a cached block holds K/V, not the recurrent state
  the linear layers reached at that position, so a prefix hit would skip tokens whose state is nowhere. (Storing
  states at block boundaries, as vLLM's hybrid prefix caching does, is not built.) Without it, moving KV between
  replicas (exports, imports, rebalancing, disaggregation) has nothing to move and falls back to recomputing.
- Refused, with a ValueError naming the option: speculative decoding (a rejected draft would have advanced the
  state), the second KV tier (``kv_offload_gib``: it holds cached prefix blocks, and there are none) and LoRA
  (adapters are not wired into the linear-attention layers).
- The block manager gets a state pool of ``max_num_seqs`` slots (``block_manager/state_pool.py``), the same
  number the ranks allocate (``Worker``).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from pagedray.workers.contract.config import EngineConfig

log = logging.getLogger(__name__)


def settle_hybrid_config(config: EngineConfig, architecture: str) -> EngineConfig:
    """``config`` as a hybrid model can run it (module docstring); ValueError naming an option it cannot take."""
    scheduler, cache, model = config.scheduler, config.cache, config.model
    if scheduler.num_speculative_tokens or scheduler.speculative_model is not None:
        raise ValueError(f"num_speculative_tokens: speculative decoding is not supported for {architecture} (its "
                         "linear-attention state cannot take back rejected drafts)")
    if cache.kv_offload_gib:
        raise ValueError(f"kv_offload_gib: the second KV tier holds prefix-cache blocks, and {architecture} runs "
                         "without prefix caching")
    if model.enable_lora:
        raise ValueError(f"enable_lora: LoRA adapters are not supported for {architecture}")
    if cache.enable_prefix_caching:
        log.info("prefix caching is off for %s: its linear-attention layers keep a recurrent state per sequence "
                 "that cached KV blocks do not hold", architecture)
        config = replace(config, cache=replace(cache, enable_prefix_caching=False))
    return config
