"""EngineStats: a snapshot of the engine for metrics (Prometheus gauges/counters at the ingress).

Counters (``num_*_total``) only grow over the engine's life; the others are instantaneous.
Per-request latencies (TTFT, inter-token) are measured by the caller that streams the outputs.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass

QUEUE_TIME_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class QueueTimeHistogram:
    """Seconds from a request's arrival at the scheduler to its first admission (vLLM's queue time),
    in cumulative Prometheus buckets (``QUEUE_TIME_BUCKETS_S``, then +Inf = ``count``)."""

    def __init__(self) -> None:
        self._counts = [0] * len(QUEUE_TIME_BUCKETS_S)   # per bucket, not cumulative
        self.count = 0
        self.sum_s = 0.0

    def observe(self, seconds: float) -> None:
        index = bisect.bisect_left(QUEUE_TIME_BUCKETS_S, seconds)
        if index < len(self._counts):
            self._counts[index] += 1
        self.count += 1
        self.sum_s += seconds

    def cumulative(self) -> tuple[tuple[float, int], ...]:
        """((upper bound, observations <= it), ...) for every finite bucket."""
        out, running = [], 0
        for bound, count in zip(QUEUE_TIME_BUCKETS_S, self._counts):
            running += count
            out.append((bound, running))
        return tuple(out)


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
    queue_time_buckets: tuple = ()     # QueueTimeHistogram.cumulative(): ((le seconds, count), ...)
    queue_time_sum_s: float = 0.0
    queue_time_count: int = 0
    spec_decode_num_drafts_total: int = 0          # decode steps of a sequence that carried drafts
    spec_decode_num_draft_tokens_total: int = 0    # draft tokens proposed
    spec_decode_num_accepted_tokens_total: int = 0
    spec_decode_accepted_per_position: tuple = ()  # ((position, proposed, accepted), ...)
    tenants: tuple = ()                            # fair share: ((name, kv_blocks, num_waiting, num_running), ...)

    def to_dict(self) -> dict:
        return asdict(self)
