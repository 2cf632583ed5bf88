"""/health and error bodies show no internals (issue #32 item 3): whatever an engine failure carries (a
worker's traceback, file paths, pids, another request's grammar text), a client sees a fixed reason; the
details go to the server log."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from helpers.fake_engine import ScriptedEngine
from pagedray.cluster.outputs import EngineDeadError
from pagedray.deploy.http.routes import create_api
from pagedray.deploy.openai.errors import INTERNAL_ERROR_MESSAGE
from pagedray.deploy.openai.metrics import ServerMetrics
from pagedray.deploy.openai.service import OpenAIService
from pagedray.deploy.openai.sse import parse_sse
from pagedray.deploy.openai.validation import ModelLimits

SECRET = ('Traceback (most recent call last):\n  File "/work/secret/workers/grammar.py", line 98, pid=4242, '
          'actor_id=deadbeef, grammar {"regex": "(a{1000}){1000}"}')


class LeakyEngine(ScriptedEngine):
    """An engine whose failures carry internals, as a Ray-wrapped worker exception does."""

    async def check_ready(self) -> None:
        raise RuntimeError(SECRET)

    async def generate(self, request_id, prompt_token_ids, params, lora=None, session=None, tenant=None):
        raise RuntimeError(SECRET)
        yield  # pragma: no cover - makes this an async generator


@pytest.fixture(scope="module")
def client(default_model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    limits = ModelLimits("m", frozenset({"m"}), len(tokenizer), 64)
    service = OpenAIService(LeakyEngine([5]), tokenizer, limits, ServerMetrics("m"))
    return TestClient(create_api(service, api_key="k"))


def _leaks(text: str) -> bool:
    return any(piece in text for piece in ("Traceback", "/work/secret", "4242", "deadbeef", "a{1000}"))


def test_health_gives_a_fixed_reason(client, caplog):
    with caplog.at_level("WARNING"):
        response = client.get("/health")
    assert response.status_code == 503 and not _leaks(response.text)
    assert response.json()["reason"].startswith("engine unavailable")
    assert "/work/secret" in caplog.text


@pytest.mark.parametrize("stream", [False, True])
def test_an_internal_failure_is_a_500_without_the_traceback(client, stream):
    response = client.post("/v1/completions", headers={"Authorization": "Bearer k"},
                           json={"prompt": "x", "max_tokens": 2, "stream": stream})
    assert not _leaks(response.text)
    body = response.json() if response.status_code != 200 else parse_sse(response.text)[0]
    assert body["error"]["message"] == INTERNAL_ERROR_MESSAGE and body["error"]["type"] == "internal_error"


def test_a_dead_engine_keeps_its_fixed_message(default_model_path):
    from transformers import AutoTokenizer

    class DeadEngine(ScriptedEngine):
        async def check_ready(self) -> None:
            raise EngineDeadError("engine dead: a step failed (the server log has the details)")

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    service = OpenAIService(DeadEngine([5]), tokenizer, ModelLimits("m", frozenset({"m"}), len(tokenizer), 64),
                            ServerMetrics("m"))
    response = TestClient(create_api(service)).get("/health")
    assert response.status_code == 503 and response.json()["reason"].startswith("engine dead")
