"""Several models behind one API (#66 part 3, deploy/openai/service_table.py) against TEST DOUBLE engines: each
request reaches the engine of the model its body names (the first model without a name), an unknown name is a 404
that lists every model and reaches no engine, /v1/models lists them all, /metrics labels each model's series, and
/health needs every model healthy. The same on Ray Serve with real engines: test_multi_model_serve.py."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from helpers.fake_engine import ScriptedEngine
from pagedray.deploy.http.routes import create_api
from pagedray.deploy.openai.metrics import MetricFamilies, ServerMetrics
from pagedray.deploy.openai.service import OpenAIService
from pagedray.deploy.openai.service_table import ServiceTable
from pagedray.deploy.openai.validation import ModelLimits

VOCAB = 49152


def _service(tokenizer, name: str, text: str, families: MetricFamilies, adapters=()) -> OpenAIService:
    engine = ScriptedEngine(tokenizer.encode(text), eos_token_id=tokenizer.eos_token_id)
    limits = ModelLimits(name, frozenset({name}), VOCAB, 64, lora_adapters=adapters)
    return OpenAIService(engine, tokenizer, limits, ServerMetrics(name, families))


@pytest.fixture
def two_models(tokenizer):
    families = MetricFamilies()
    chat = _service(tokenizer, "chat-model", " alpha beta gamma", families, adapters=(("sql", "/adapters/sql"),))
    other = _service(tokenizer, "other-model", " one two three", families)
    return TestClient(create_api(ServiceTable([chat, other]))), chat.engine, other.engine


def test_each_request_reaches_the_engine_of_the_model_it_names(two_models):
    client, chat, other = two_models
    body = {"prompt": "Hi", "max_tokens": 3, "temperature": 0}
    first = client.post("/v1/completions", json={**body, "model": "other-model"}).json()
    assert first["model"] == "other-model" and first["choices"][0]["text"] == " one two three"
    assert len(other.calls) == 1 and not chat.calls
    unnamed = client.post("/v1/completions", json=body).json()            # the first model
    assert unnamed["model"] == "chat-model" and unnamed["choices"][0]["text"] == " alpha beta gamma"
    adapter = client.post("/v1/chat/completions", json={"model": "chat-model:sql", "max_tokens": 2,
                                                        "messages": [{"role": "user", "content": "Hi"}]}).json()
    assert adapter["model"] == "sql" and chat.loras[-1].name == "sql"
    assert len(chat.calls) == 2 and len(other.calls) == 1


def test_an_unknown_model_is_a_404_listing_every_model_and_reaches_no_engine(two_models):
    client, chat, other = two_models
    response = client.post("/v1/completions", json={"model": "nope", "prompt": "Hi", "max_tokens": 2})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["param"] == "model" and error["code"] == "model_not_found"
    assert "'nope'" in error["message"] and "'chat-model'" in error["message"] and "'other-model'" in error["message"]
    assert client.post("/v1/embeddings", json={"model": "nope", "input": "x"}).status_code == 404
    assert not chat.calls and not other.calls


def test_models_metrics_and_health_cover_every_model(two_models):
    client, _, other = two_models
    ids = [card["id"] for card in client.get("/v1/models").json()["data"]]
    assert ids == ["chat-model", "sql", "other-model"]
    assert client.get("/v1/models/other-model").json()["id"] == "other-model"
    client.post("/v1/completions", json={"model": "other-model", "prompt": "Hi", "max_tokens": 2})
    text = client.get("/metrics").text
    assert 'pagedray:requests_total{endpoint="completions",model_name="other-model",outcome="length"} 1.0' in text
    assert 'pagedray:prompt_tokens_total{model_name="chat-model"} 0.0' in text
    assert text.count("# TYPE pagedray:prompt_tokens_total counter") == 1
    assert client.get("/health").status_code == 200
    other.dead = True
    assert client.get("/health").status_code == 503


def test_two_models_cannot_share_a_name(tokenizer):
    families = MetricFamilies()
    with pytest.raises(ValueError, match="served_model_name: 'same'"):
        ServiceTable([_service(tokenizer, "same", " a", families), _service(tokenizer, "same", " b", families)])
