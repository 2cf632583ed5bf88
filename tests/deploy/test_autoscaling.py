"""Autoscaling of the engine deployment: the KV-pressure policy (deploy/routing/autoscaling.py) as a function and its
wiring through build_app. The real app scaling 1 -> 2 -> 1 under load: tests/e2e/test_serve_yaml_autoscaling.py
(slow)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pagedray.cluster.stats import EngineStats
from pagedray.deploy.routing.autoscaling import (
    KV_PRESSURE_POLICY,
    TARGET_KV_USAGE,
    autoscaling_stats,
    kv_pressure_policy,
)


class FakeConfig:
    def __init__(self, target_ongoing: float) -> None:
        self._target = target_ongoing

    def get_target_ongoing_requests(self) -> float:
        return self._target


def context(current: int, ongoing: float, kv_usage: list[float] | None, target_ongoing: float = 4.0):
    metrics = None if kv_usage is None else {"kv_usage": {f"r{i}": v for i, v in enumerate(kv_usage)}}
    return SimpleNamespace(current_num_replicas=current, target_num_replicas=current, total_num_requests=ongoing,
                           aggregated_metrics=metrics, config=FakeConfig(target_ongoing))


def test_the_policy_takes_the_larger_of_the_request_and_the_kv_pressure():
    assert kv_pressure_policy(context(2, ongoing=16, kv_usage=[0.1, 0.2]))[0] == pytest.approx(4.0)   # requests
    full = kv_pressure_policy(context(2, ongoing=2, kv_usage=[1.0, 1.0]))[0]
    assert full == pytest.approx(2 / TARGET_KV_USAGE)                                                 # KV
    assert kv_pressure_policy(context(2, ongoing=2, kv_usage=None))[0] == pytest.approx(0.5)          # no reports
    assert kv_pressure_policy(context(0, ongoing=5, kv_usage=None)) == (0, {})


def test_replicas_report_kv_usage_running_and_waiting():
    stats = EngineStats(num_running=3, num_waiting=2, num_blocks=10, num_free_blocks=4, kv_usage=0.6,
                        prefix_hit_rate=0.0, prefix_query_tokens_total=0, prefix_hit_tokens_total=0,
                        num_preemptions_total=0, num_prompt_tokens_total=0, num_generation_tokens_total=0,
                        num_computed_tokens_total=0, num_steps_total=0, num_requests_finished_total=0)
    assert autoscaling_stats(stats) == {"kv_usage": 0.6, "num_running": 3.0, "num_waiting": 2.0}


def test_build_app_passes_the_policy_to_serve():
    from pagedray.deploy.serve.app import build_app

    scaling = {"max_replicas": 2, "policy": {"policy_function": KV_PRESSURE_POLICY}}
    engine = build_app({"autoscaling_config": scaling})._bound_deployment.init_args[0]._bound_deployment
    assert engine._deployment_config.autoscaling_config.policy.policy_function == KV_PRESSURE_POLICY
