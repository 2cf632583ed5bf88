"""/metrics content (deploy/openai/metrics.py), the per-replica view of the ingress (ingress.HandleEngineClient over
routing.replica_summaries) and the Grafana dashboard (deploy/http/grafana/pagedray.json): valid, and reading only
metric names the app exports."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib
import re

import jsonschema
import pytest
from pagedray.cluster.outputs import EngineDeadError
from pagedray.cluster.stats import EngineStats, QueueTimeHistogram
from pagedray.deploy.openai.metrics import ReplicaState, ServerMetrics
from pagedray.deploy.routing import registry as router_registry
from pagedray.deploy.routing import router as routing
from pagedray.deploy.serve import ingress

DASHBOARD = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "http" / "grafana" / "pagedray.json"
DASHBOARD_SCHEMA = {   # what Grafana needs to import a dashboard of Prometheus time series panels
    "type": "object",
    "required": ["title", "uid", "schemaVersion", "panels", "templating"],
    "properties": {
        "title": {"type": "string", "minLength": 1},
        "uid": {"type": "string", "minLength": 1},
        "schemaVersion": {"type": "integer"},
        "templating": {"type": "object", "required": ["list"], "properties": {
            "list": {"type": "array", "items": {"type": "object", "required": ["name", "type"]}}}},
        "panels": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "required": ["id", "type", "title", "gridPos", "targets"],
            "properties": {
                "id": {"type": "integer"},
                "type": {"enum": ["timeseries", "stat", "gauge", "table"]},
                "gridPos": {"type": "object", "required": ["h", "w", "x", "y"]},
                "targets": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["expr", "refId"],
                    "properties": {"expr": {"type": "string", "minLength": 1}}}},
            }}},
    },
}
METRIC_NAME = re.compile(r"pagedray:[a-z0-9_:]+")


def stats(**overrides) -> EngineStats:
    values = dict(num_running=2, num_waiting=1, num_blocks=100, num_free_blocks=60, kv_usage=0.4,
                  prefix_hit_rate=0.5, prefix_query_tokens_total=64, prefix_hit_tokens_total=32,
                  num_preemptions_total=3, num_prompt_tokens_total=64, num_generation_tokens_total=10,
                  num_computed_tokens_total=42, num_steps_total=7, num_requests_finished_total=1)
    return EngineStats(**{**values, **overrides})


def exported_names() -> set[str]:
    metrics = ServerMetrics("m")
    # per-position acceptance has a sample once a speculative step ran, as a labelled counter after its first use
    metrics.engine.update([ReplicaState("r1", stats(spec_decode_accepted_per_position=((0, 2, 1),)))])
    metrics.record_outcome("completions", "stop")
    text = metrics.render().decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_every_replica_gets_its_own_labelled_series():
    queue = QueueTimeHistogram()
    for seconds in (0.004, 0.3, 0.3, 500.0):
        queue.observe(seconds)
    waited = stats(queue_time_buckets=queue.cumulative(), queue_time_sum_s=queue.sum_s, queue_time_count=queue.count)
    waited = dataclasses.replace(waited, spec_decode_num_drafts_total=4, spec_decode_num_draft_tokens_total=12,
                                 spec_decode_num_accepted_tokens_total=7,
                                 spec_decode_accepted_per_position=((0, 4, 4), (1, 4, 2), (2, 4, 1)))
    metrics = ServerMetrics("smol")
    metrics.engine.update([ReplicaState("a", waited), ReplicaState("b", stats(num_running=5, kv_usage=0.9),
                                                                    healthy=False, reason="rank 1 died")])
    text = metrics.render().decode()
    queue_series = 'pagedray:request_queue_time_seconds_bucket{le="%s",model_name="smol",replica="a"} %s'
    assert queue_series % ("0.01", "1.0") in text and queue_series % ("0.5", "3.0") in text
    assert queue_series % ("120.0", "3.0") in text and queue_series % ("+Inf", "4.0") in text
    assert 'pagedray:request_queue_time_seconds_sum{model_name="smol",replica="a"} 500.604' in text
    assert 'pagedray:num_requests_running{model_name="smol",replica="a"} 2.0' in text
    assert 'pagedray:num_requests_running{model_name="smol",replica="b"} 5.0' in text
    assert 'pagedray:kv_cache_usage_perc{model_name="smol",replica="b"} 0.9' in text
    assert 'pagedray:prefix_cache_queries_total{model_name="smol",replica="a"} 64.0' in text
    assert 'pagedray:prefix_cache_hits_total{model_name="smol",replica="a"} 32.0' in text
    assert 'pagedray:num_preemptions_total{model_name="smol",replica="a"} 3.0' in text
    assert 'pagedray:engine_steps_total{model_name="smol",replica="a"} 7.0' in text
    assert 'pagedray:computed_tokens_total{model_name="smol",replica="a"} 42.0' in text
    assert 'pagedray:engine_healthy{model_name="smol",replica="a"} 1.0' in text
    assert 'pagedray:engine_healthy{model_name="smol",replica="b"} 0.0' in text
    assert 'pagedray:spec_decode_num_draft_tokens_total{model_name="smol",replica="a"} 12.0' in text
    assert 'pagedray:spec_decode_num_accepted_tokens_total{model_name="smol",replica="a"} 7.0' in text
    assert 'pagedray:spec_decode_num_drafts_total{model_name="smol",replica="a"} 4.0' in text
    per_position = ('pagedray:spec_decode_num_accepted_tokens_per_pos_total{model_name="smol",position="%d",'
                    'replica="a"} %s')
    assert per_position % (0, "4.0") in text and per_position % (2, "1.0") in text
    metrics.record_outcome("chat", "stop")
    assert 'pagedray:requests_total{endpoint="chat",model_name="smol",outcome="stop"} 1.0' in metrics.render().decode()


class StubReplica:
    def __init__(self, summary: dict) -> None:
        self.routing_stats = summary


class StubRouter:
    def __init__(self, summaries: list[dict]) -> None:
        self.curr_replicas = {i: StubReplica(s) for i, s in enumerate(summaries)}


def summary(replica: str, healthy: bool = True, reason: str = "", **stat_overrides) -> dict:
    return {"replica": replica, "prefix_hashes": [], "stats": stats(**stat_overrides).to_dict(),
            "healthy": healthy, "reason": reason}


class StubHandle:
    """A DeploymentHandle stand-in: its deployment id, and one replica answering ``replica_stats``."""

    class deployment_id:   # noqa: N801 - mirrors DeploymentHandle.deployment_id
        app_name, name = "app", "PagedEngine"

    class replica_stats:   # noqa: N801 - mirrors handle.replica_stats.remote()
        @staticmethod
        def remote():
            async def answer():
                return "only", stats(num_running=4)
            return answer()


def test_the_ingress_sees_every_replica_the_router_sees_and_fails_health_for_any_dead_one():
    client = ingress.HandleEngineClient(StubHandle())
    # no cache-aware router in this process: the replica that answers
    only = asyncio.run(client.replica_states())
    assert [(s.replica, s.stats.num_running) for s in only] == [("only", 4)]
    router = StubRouter([summary("a"), summary("b", num_running=7), {}])   # {}: a replica not polled yet
    router_registry.register("app", "PagedEngine", router)
    try:
        states = asyncio.run(client.replica_states())
        assert [(s.replica, s.stats.num_running, s.healthy) for s in states] == [("a", 2, True), ("b", 7, True)]
        router.curr_replicas[1].routing_stats = summary("b", healthy=False, reason="a TP rank failed")
        with pytest.raises(EngineDeadError, match="engine replica b: a TP rank failed"):
            asyncio.run(client.check_ready())
    finally:
        router_registry.unregister("app", "PagedEngine")
    assert routing.replica_summaries("app", "PagedEngine") is None


def test_the_grafana_dashboard_is_valid_and_reads_only_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    jsonschema.validate(dashboard, DASHBOARD_SCHEMA)
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    referenced = {name for expr in exprs for name in METRIC_NAME.findall(expr)}
    assert referenced and referenced <= exported_names(), referenced - exported_names()
    panel_ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(panel_ids) == len(set(panel_ids))
    titles = " ".join(panel["title"] for panel in dashboard["panels"]).lower()
    for topic in ("tokens", "first token", "inter-token", "kv cache", "waiting", "preemptions", "prefix", "replica",
                  "queue time"):
        assert topic in titles, topic
