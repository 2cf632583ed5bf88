"""The ``tenants`` option at the HTTP front end: parsing, who a key is, the tenant reaching the engine, 401 / 403 /
429 bodies, per-tenant gauges on /metrics, usage's kv_block_seconds (over the ScriptedEngine test double)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from fastapi.testclient import TestClient
from helpers.bad_requests import assert_openai_error
from helpers.fake_engine import FakeStats, ScriptedEngine
from pagedray.cluster.fair_share import TenantQuotaError
from pagedray.deploy.http.routes import create_api
from pagedray.deploy.http.tenants import ApiKeys, parse_tenants
from pagedray.deploy.openai.metrics import ServerMetrics
from pagedray.deploy.openai.service import OpenAIService
from pagedray.deploy.openai.validation import ModelLimits
from pagedray.workers.contract.config import TenantConfig

MODEL = "fake-model"
TABLE = {"acme": {"api_keys": ["sk-acme-1", "sk-acme-2"], "weight": 2, "max_kv_fraction": 0.5},
         "beta": {"api_keys": ["sk-beta"], "max_queued_requests": 4}}
OK = {"prompt": "x", "max_tokens": 2}


def _bearer(key):
    return {"Authorization": f"Bearer {key}"}


def _client(tokenizer, engine=None, api_key="admin"):
    engine = engine or ScriptedEngine([5, 6, 7])
    limits = ModelLimits(MODEL, frozenset({MODEL}), 49152, 64)
    service = OpenAIService(engine, tokenizer, limits, ServerMetrics(MODEL))
    _, keys = parse_tenants(TABLE)
    return TestClient(create_api(service, api_key=api_key, tenant_keys=keys)), engine


def test_parse_tenants_gives_the_engine_policy_without_keys():
    configs, keys = parse_tenants(TABLE)
    assert configs == (TenantConfig("acme", weight=2, max_kv_fraction=0.5),
                       TenantConfig("beta", max_queued_requests=4))
    assert sorted(keys.values()) == ["acme", "acme", "beta"]
    assert all(b"sk-" not in digest for digest in keys)      # digests, not the keys
    assert parse_tenants(None) == ((), {})


@pytest.mark.parametrize("table, message", [
    ({}, "tenants: must be a non-empty mapping"),
    ({"a": []}, "tenants.a: must be a mapping"),
    ({"a": {"api_keys": ["k"], "wieght": 2}}, "tenants.a: unknown field 'wieght'"),
    ({"a": {"api_keys": ["k"], "weight": 0}}, r"tenants.a.weight: must be a number in \(0, 1e6\]"),
    ({"a": {"api_keys": ["k"], "max_kv_fraction": 1.5}}, r"tenants.a.max_kv_fraction: must be in \(0, 1\]"),
    ({"a": {"api_keys": ["k"], "max_queued_requests": 0}}, "tenants.a.max_queued_requests: must be an integer"),
    ({"a": {"api_keys": []}}, "tenants.a.api_keys: give the tenant at least one key"),
    ({"a": {"api_keys": "k"}}, "tenants.a.api_keys: must be a list of non-empty strings"),
    ({"a": {"api_keys": ["k"]}, "b": {"api_keys": ["k"]}},
     r"tenants.b.api_keys: a key is given twice \(also for 'a'\)"),
    ({"bad name": {"api_keys": ["k"]}}, "tenants: a tenant name must be 1-64 letters"),
])
def test_a_malformed_table_names_the_entry(table, message):
    with pytest.raises(ValueError, match=message):
        parse_tenants(table)


def test_api_keys_name_the_tenant_and_refuse_the_rest():
    keys = ApiKeys("admin", parse_tenants(TABLE)[1])
    assert keys.tenant_of("sk-acme-2") == "acme" and keys.tenant_of(" sk-beta ") == "beta"
    assert keys.tenant_of("admin") is None          # the default tenant
    for bad in (None, "", "sk-acme", "ADMIN"):
        with pytest.raises(Exception, match="missing or incorrect API key"):
            keys.tenant_of(bad)
    with pytest.raises(ValueError, match="a tenant's key equals api_key"):
        ApiKeys("sk-beta", parse_tenants(TABLE)[1])
    assert ApiKeys().tenant_of(None) is None        # no keys at all: open, as before


def test_each_request_reaches_the_engine_as_its_keys_tenant(tokenizer):
    client, engine = _client(tokenizer)
    for key in ("sk-acme-1", "sk-beta", "admin"):
        response = client.post("/v1/completions", json=OK, headers=_bearer(key))
        assert response.status_code == 200, response.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    streamed = client.post("/v1/chat/completions", json={**chat, "stream": True}, headers=_bearer("sk-acme-2"))
    assert streamed.status_code == 200
    assert client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2},
                       headers=_bearer("sk-beta")).status_code == 200
    messages = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert client.post("/v1/messages", json=messages, headers={"x-api-key": "sk-acme-1"}).status_code == 200
    assert engine.tenants == ["acme", "beta", None, "acme", "beta", "acme"]


def test_unknown_keys_are_401_and_tenant_keys_cannot_change_adapters(tokenizer):
    client, engine = _client(tokenizer)
    assert_openai_error(client.post("/v1/completions", json=OK), 401, None)
    assert_openai_error(client.post("/v1/completions", json=OK, headers=_bearer("sk-nobody")), 401, None)
    assert_openai_error(client.get("/v1/models", headers=_bearer("nope")), 401, None)
    assert client.get("/v1/models", headers=_bearer("sk-beta")).status_code == 200
    response = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp/x"},
                           headers=_bearer("sk-acme-1"))
    assert_openai_error(response, 403, None)
    assert "admin api_key" in response.json()["error"]["message"]
    assert engine.calls == []


@pytest.mark.parametrize("stream", [False, True])
def test_a_tenant_quota_is_a_429_that_names_it(tokenizer, stream):
    refusal = TenantQuotaError("tenant 'beta': 4 requests are waiting (its max_queued_requests=4); retry later")
    client, _ = _client(tokenizer, ScriptedEngine([5], reject_with=refusal))
    response = client.post("/v1/completions", json={**OK, "stream": stream}, headers=_bearer("sk-beta"))
    assert_openai_error(response, 429, None)
    assert "tenant 'beta'" in response.json()["error"]["message"] and "max_queued_requests=4" in response.text


@dataclass
class _TenantStats(FakeStats):
    tenants: tuple = ()


class _TenantEngine(ScriptedEngine):
    async def stats(self):
        return _TenantStats(num_running=0, tenants=(("acme", 12, 3, 2), ("beta", 0, 1, 0)))


def test_metrics_show_each_tenant_by_name_never_by_key(tokenizer):
    client, _ = _client(tokenizer, _TenantEngine([5]))
    text = client.get("/metrics", headers=_bearer("admin")).text
    labels = f'model_name="{MODEL}",replica="fake-replica"'
    assert f'pagedray:tenant_kv_blocks{{{labels},tenant="acme"}} 12.0' in text
    assert f'pagedray:tenant_num_requests_waiting{{{labels},tenant="acme"}} 3.0' in text
    assert f'pagedray:tenant_num_requests_running{{{labels},tenant="beta"}} 0.0' in text
    assert "sk-" not in text


def test_usage_reports_the_kv_block_seconds_of_every_prompt(tokenizer):
    class Held(ScriptedEngine):
        async def generate(self, *args, **kwargs):
            async for out in super().generate(*args, **kwargs):
                out.kv_block_seconds = 1.25 if out.finished else 0.5
                yield out

    client, _ = _client(tokenizer, Held([5, 6]), api_key=None)
    body = client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2},
                       headers=_bearer("sk-beta")).json()
    assert body["usage"]["kv_block_seconds"] == 2.5
