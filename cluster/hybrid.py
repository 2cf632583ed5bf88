"""What a hybrid model (linear-attention layers with a per-sequence recurrent state: Qwen3.5 / 3.6) changes in an
engine's configuration, settled once before any rank starts.

- Prefix caching keeps recurrent-state snapshots beside the KV blocks (``hybrid_prefix_states`` of them; a
  cached block holds K/V, not the state the linear layers reached at that position). A sequence takes a
  snapshot, inside its prefill step, at the end of its prompt's last full block and where its prompt leaves the
  KV blocks already cached (the point other prompts sharing that prefix branch off), and one while decoding at
  its latest block end; a later prompt reuses the deepest cached block that has a snapshot, its seat's state
  copied from it (block_manager/state_pool.py).
  A log line says how many snapshots are kept. With ``hybrid_prefix_states`` 0, prefix caching is switched off
  (also said in a log line).
- Moving KV between replicas (exports, imports, peer pulls, rebalancing, disaggregation) would move blocks without
  their states: peer pulls are switched off, and exports are refused (continuations recompute).
- Refused, with a ValueError naming the option: speculative decoding (a rejected draft would have advanced the
  state) and the second KV tier (``kv_offload_gib``: its blocks come back without states). LoRA adapters adapt the
  full-attention layers' q/k/v/o and the dense MLPs (workers/lora/model_lora.py); an adapter naming a
  linear-attention layer's module is refused when it is loaded.
- The block manager gets a state pool of ``max_num_seqs`` seats plus the snapshots (``state_pool.py``), the same
  number of slots every rank allocates (``Worker``).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from pagedray.workers.contract.config import EngineConfig

log = logging.getLogger(__name__)


def settle_hybrid_config(config: EngineConfig, architecture: str) -> EngineConfig:
    """``config`` as a hybrid model can run it (module docstring); ValueError naming an option it cannot take."""
    scheduler, cache = config.scheduler, config.cache
    if scheduler.num_speculative_tokens or scheduler.speculative_model is not None:
        raise ValueError(f"num_speculative_tokens: speculative decoding is not supported for {architecture} (its "
                         "linear-attention state cannot take back rejected drafts)")
    if cache.kv_offload_gib:
        raise ValueError(f"kv_offload_gib: the second KV tier would bring back blocks without the recurrent states "
                         f"{architecture} needs with them")
    if not cache.enable_prefix_caching:
        return replace(config, cache=replace(cache, kv_peer_pull=False))
    if not cache.hybrid_prefix_states:
        log.info("prefix caching is off for %s: hybrid_prefix_states is 0, and its linear-attention layers keep a "
                 "recurrent state per sequence that cached KV blocks do not hold", architecture)
        return replace(config, cache=replace(cache, enable_prefix_caching=False, kv_peer_pull=False))
    log.info("prefix caching for %s keeps %d recurrent-state snapshots (hybrid_prefix_states): a prefix hit resumes "
             "from the deepest cached block that has one", architecture, cache.hybrid_prefix_states)
    return replace(config, cache=replace(cache, kv_peer_pull=False))
