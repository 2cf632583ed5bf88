"""KV-pressure autoscaling of the engine deployment (a Serve custom autoscaling policy).

Serve's default policy scales on ongoing requests per replica (``target_ongoing_requests``). An LLM
engine also runs out of room another way: its KV cache fills, requests wait for blocks although
the number of ongoing requests looks fine (long prompts, long outputs). Each engine replica therefore
reports, through Serve's ``record_autoscaling_stats`` hook, ``kv_usage`` (0..1), ``num_running`` and
``num_waiting`` (``autoscaling_stats``); Serve averages them per replica over ``look_back_period_s``.

``kv_pressure_policy`` wants ``current x max(ongoing / (target_ongoing_requests x current),
mean kv_usage / TARGET_KV_USAGE)`` replicas: Serve's own rule, or more when the replicas' KV caches are
fuller than ``TARGET_KV_USAGE``. Serve applies ``min_replicas`` / ``max_replicas``, the up/down
scaling factors and ``upscale_delay_s`` / ``downscale_delay_s`` to that number, as for its own policy.
Use it with::

    autoscaling_config:
      min_replicas: 1
      max_replicas: 4
      target_ongoing_requests: 32
      policy: {policy_function: "pagedray.deploy.autoscaling:kv_pressure_policy"}

The same three figures are on /metrics (``pagedray:kv_cache_usage_perc``, ``..._num_requests_running``,
``..._num_requests_waiting``) for autoscalers outside Serve.
"""

from __future__ import annotations

KV_PRESSURE_POLICY = "pagedray.deploy.autoscaling:kv_pressure_policy"
TARGET_KV_USAGE = 0.85   # KV usage per replica above which more replicas are wanted
AUTOSCALING_METRICS = ("kv_usage", "num_running", "num_waiting")


def autoscaling_stats(stats) -> dict[str, float]:
    """An engine replica's report for ``record_autoscaling_stats``, from its EngineStats."""
    return {name: float(getattr(stats, name)) for name in AUTOSCALING_METRICS}


def _mean(per_replica: dict | None) -> float | None:
    values = list((per_replica or {}).values())
    return sum(values) / len(values) if values else None


def kv_pressure_policy(ctx) -> tuple[float, dict]:
    """Serve custom autoscaling policy: (desired replicas, policy state); see the module docstring."""
    current = ctx.current_num_replicas
    if current == 0:
        return ctx.target_num_replicas, {}
    by_requests = ctx.total_num_requests / (ctx.config.get_target_ongoing_requests() * current)
    kv_usage = _mean((ctx.aggregated_metrics or {}).get("kv_usage"))
    by_kv = 0.0 if kv_usage is None else kv_usage / TARGET_KV_USAGE
    return current * max(by_requests, by_kv), {}
