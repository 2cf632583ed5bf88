"""Autoscaling of the engine deployment: the KV-pressure policy (deploy/autoscaling.py) as a function, its
wiring through build_app, and (slow) a real app going from 1 to 2 engine replicas under load and back."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from pagedray.cluster.stats import EngineStats
from pagedray.deploy.autoscaling import KV_PRESSURE_POLICY, TARGET_KV_USAGE, autoscaling_stats, kv_pressure_policy


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
    from pagedray.deploy.app import build_app

    scaling = {"max_replicas": 2, "policy": {"policy_function": KV_PRESSURE_POLICY}}
    engine = build_app({"autoscaling_config": scaling})._bound_deployment.init_args[0]._bound_deployment
    assert engine._deployment_config.autoscaling_config.policy.policy_function == KV_PRESSURE_POLICY


def _running_engine_replicas(app_name: str) -> int:
    from ray import serve

    deployment = serve.status().applications[app_name].deployments["PagedEngine"]
    return deployment.replica_states.get("RUNNING", 0)


def _wait_for_replicas(app_name: str, count: int, hang_guard_s: float = 600) -> None:
    deadline = time.monotonic() + hang_guard_s
    while _running_engine_replicas(app_name) != count:
        assert time.monotonic() < deadline, f"{app_name}: still not {count} running engine replicas"
        time.sleep(1.0)


@pytest.mark.slow
def test_the_engine_scales_from_one_to_two_replicas_under_load_and_back(ray_session, default_model_path):
    """Serve's own signal (ongoing requests): 6 long streams against target_ongoing_requests 2 want 3
    replicas, capped at 2; once they end, the idle replicas want 1 again. The delays are short so that the
    test is quick; the waits are hang guards (the test never depends on how fast the machine is)."""
    from serve_fixtures import API_KEY, start_app, stop_app

    scaling = {"min_replicas": 1, "max_replicas": 2, "initial_replicas": 1, "target_ongoing_requests": 2,
               "upscale_delay_s": 1, "downscale_delay_s": 5, "metrics_interval_s": 0.5, "look_back_period_s": 2,
               "policy": {"policy_function": KV_PRESSURE_POLICY}}
    app = start_app(default_model_path, autoscaling_config=scaling, threads_per_worker=1)
    try:
        assert _running_engine_replicas(app.name) == 1
        stop = threading.Event()

        def stream_until_stopped() -> None:
            body = {"prompt": "Count to a thousand:", "max_tokens": 64, "ignore_eos": True}
            with httpx.Client(base_url=app.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=600,
                              trust_env=False) as client:
                while not stop.is_set():
                    client.post("/v1/completions", json=body)

        clients = [threading.Thread(target=stream_until_stopped, daemon=True) for _ in range(6)]
        for thread in clients:
            thread.start()
        _wait_for_replicas(app.name, 2)
        stop.set()
        for thread in clients:
            thread.join(600)
        _wait_for_replicas(app.name, 1)
    finally:
        stop_app(app)
