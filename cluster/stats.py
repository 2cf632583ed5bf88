"""EngineStats: a snapshot of the engine for metrics (Prometheus gauges/counters at the ingress).

Counters (``num_*_total``) only grow over the engine's life; the others are instantaneous.
Per-request latencies (TTFT, inter-token) are measured by the caller that streams the outputs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    kv_usage: float                    # fraction of KV blocks referenced, 0..1
    prefix_hit_rate: float             # prompt tokens served from the prefix cache / looked up
    prefix_query_tokens_total: int
    prefix_hit_tokens_total: int
    num_preemptions_total: int
    num_prompt_tokens_total: int       # prompt tokens of admitted requests
    num_generation_tokens_total: int   # sampled tokens
    num_computed_tokens_total: int     # tokens run through the model (prefill chunks + decodes)
    num_steps_total: int
    num_requests_finished_total: int
    num_rank_restarts_total: int = 0   # TP groups rebuilt after a rank failure

    def to_dict(self) -> dict:
        return asdict(self)
