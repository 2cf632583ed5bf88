"""LoRA adapters through the served app (Ray Serve, the engine in its own deployment, fp32): ``lora_modules``
serves an adapter under its name and as ``<model>:<adapter>``; its greedy tokens equal transformers with the
adapter merged into the weights, the base model's stay the base model's, both names reach the same adapter,
``/v1/models`` lists it with its parent, and an unknown adapter name is a 404 that changes nothing. An adapter
loaded at run time serves the same way; with one slot and one host copy, requests of two adapters and the
base model in flight at once all finish exactly, also when one adapter is unloaded while its requests run."""

from __future__ import annotations

import httpx
import pytest
from helpers.hf_oracle import hf_greedy, load_hf_model
from helpers.lora_adapters import merged_hf_model, save_adapter
from helpers.serve_fixtures import API_KEY, start_app, stop_app

pytestmark = pytest.mark.integration   # starts Ray and Serve (tests/conftest.py)

PROMPT = [1, 504, 3145, 314, 260, 2491, 282, 3916, 30]     # SmolLM2 token ids
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapter(default_model_path, tmp_path_factory):
    return save_adapter(tmp_path_factory.mktemp("sql-adapter"), default_model_path, ["q_proj", "v_proj", "down_proj"],
                        rank=8, alpha=16, seed=11, std=0.08)


@pytest.fixture(scope="module")
def app(ray_session, default_model_path, adapter):
    running = start_app(default_model_path, enable_lora=True, max_lora_rank=8, lora_modules=f"sql={adapter}",
                        max_loras=1, max_queued_requests=16)   # one slot, one host copy: adapters take turns
    yield running
    stop_app(running)


def _completion(http: httpx.Client, model: str) -> str:
    response = http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                  "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == ("sql" if model.endswith("sql") else model)
    return body["choices"][0]["text"]


def test_an_adapter_is_served_by_name_exactly_as_transformers_with_it_merged(app, default_model_path, adapter):
    expected = hf_greedy(merged_hf_model(default_model_path, adapter), PROMPT, MAX_TOKENS)
    base = hf_greedy(load_hf_model(default_model_path), PROMPT, MAX_TOKENS)
    assert expected != base                                    # the adapter changes the output
    with httpx.Client(base_url=app.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300,
                      trust_env=False) as http:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(default_model_path)
        text = tokenizer.decode(expected, skip_special_tokens=True)
        assert _completion(http, "sql") == text
        assert _completion(http, f"{app.model}:sql") == text
        assert _completion(http, app.model) == tokenizer.decode(base, skip_special_tokens=True)
        cards = http.get("/v1/models").json()["data"]
        assert [(c["id"], c.get("parent")) for c in cards] == [(app.model, None), ("sql", app.model)]
        missing = http.post("/v1/completions", json={"model": "nope", "prompt": PROMPT, "max_tokens": 2})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def _streamed_text(response) -> str:
    import json

    text = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            text.extend(choice["text"] for choice in json.loads(line[6:])["choices"])
    return "".join(text)


@pytest.mark.slow   # the extended tier (README: -m slow): test_lora.py's engine-level load and unload
def test_adapters_loaded_and_unloaded_under_load_lose_no_request(app, default_model_path, adapter, tmp_path):
    from contextlib import ExitStack

    from transformers import AutoTokenizer

    tone = save_adapter(tmp_path / "tone", default_model_path, ["k_proj", "o_proj", "up_proj"], rank=4, alpha=8,
                        seed=12, std=0.08)
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    expected = {model: tokenizer.decode(hf_greedy(hf, PROMPT, MAX_TOKENS), skip_special_tokens=True)
                for model, hf in [("sql", merged_hf_model(default_model_path, adapter)),
                                  ("tone", merged_hf_model(default_model_path, tone)),
                                  (app.model, load_hf_model(default_model_path))]}
    assert len(set(expected.values())) == 3
    with httpx.Client(base_url=app.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300,
                      trust_env=False) as http:
        missing = http.post("/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": str(tmp_path / "no")})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
        assert "'gone'" in missing.json()["error"]["message"]
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "tone", "lora_path": tone})
        assert loaded.status_code == 200, loaded.text
        assert [c["id"] for c in http.get("/v1/models").json()["data"]] == [app.model, "sql", "tone"]
        models = ["sql", "tone", app.model] * 4
        with ExitStack() as streams:
            responses = []
            for model in models:     # each stream is open (validated, in the engine) once its headers are here
                response = streams.enter_context(http.stream("POST", "/v1/completions", json={
                    "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True, "stream": True}))
                assert response.status_code == 200
                responses.append(response)
            unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
            assert unloaded.status_code == 200, unloaded.text
            texts = [_streamed_text(response) for response in responses]
        assert texts == [expected[model] for model in models]
        after = http.post("/v1/completions", json={"model": "sql", "prompt": PROMPT, "max_tokens": 2})
        assert after.status_code == 404 and after.json()["error"]["param"] == "model"
        assert _completion(http, "tone") == expected["tone"]
