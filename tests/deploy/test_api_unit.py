"""HTTP layer against a TEST DOUBLE engine (tests/helpers/fake_engine.py): no Ray, no model forward.

Covers request parsing and validation (every bad-input case -> OpenAI error body, engine never
called), auth, body limit, overload mapping, health, metrics text, SSE framing and stop strings on
incrementally detokenized text. The same behaviour against the real engine is in test_serve_app.py.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi.testclient import TestClient
from helpers.bad_requests import assert_openai_error, malformed_cases, send
from helpers.fake_engine import ScriptedEngine, queue_full
from helpers.gates import GatedTokenizer
from pagedray.cluster.outputs import EngineDrainingError
from pagedray.deploy.http.routes import create_api
from pagedray.deploy.openai.metrics import ServerMetrics
from pagedray.deploy.openai.service import OpenAIService
from pagedray.deploy.openai.sse import parse_sse
from pagedray.deploy.openai.validation import ModelLimits

MODEL = "fake-model"
MAX_MODEL_LEN = 64
VOCAB = 49152
SCRIPT_TEXT = " The quick brown fox jumps over the lazy dog. Then it rests."


def make_client(tokenizer, engine=None, **api_kwargs):
    engine = engine or ScriptedEngine(tokenizer.encode(SCRIPT_TEXT), eos_token_id=tokenizer.eos_token_id)
    limits = ModelLimits(MODEL, frozenset({MODEL, "default"}), VOCAB, MAX_MODEL_LEN)
    service = OpenAIService(engine, tokenizer, limits, ServerMetrics(MODEL))
    return TestClient(create_api(service, **api_kwargs)), engine


@pytest.fixture(scope="module")
def client_and_engine(tokenizer):
    return make_client(tokenizer)


@pytest.mark.parametrize("case", malformed_cases(MODEL, MAX_MODEL_LEN, VOCAB), ids=lambda c: c[0])
def test_bad_input_is_rejected_before_the_engine(client_and_engine, case):
    client, engine = client_and_engine
    _, path, body, status, param = case
    calls_before = len(engine.calls)
    assert_openai_error(send(client, path, body), status, param)
    assert len(engine.calls) == calls_before


def test_completion_text_matches_script(client_and_engine, tokenizer):
    client, _ = client_and_engine
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "Say:", "max_tokens": 5})
    assert response.status_code == 200, response.text
    body = response.json()
    expected = tokenizer.decode(tokenizer.encode(SCRIPT_TEXT)[:5])
    assert body["choices"][0]["text"] == expected
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(tokenizer.encode("Say:")), "completion_tokens": 5,
                             "total_tokens": len(tokenizer.encode("Say:")) + 5,
                             "prompt_tokens_details": {"cached_tokens": 0}, "kv_block_seconds": 0.0}


def test_usage_counts_cached_prompt_tokens_once_per_prompt(client_and_engine):
    client, engine = client_and_engine
    engine.cached_prompt_tokens = 16
    try:
        body = {"model": MODEL, "prompt": ["Say:", "Say it:"], "max_tokens": 3, "n": 2}
        whole = client.post("/v1/completions", json=body).json()["usage"]
        assert whole["prompt_tokens_details"] == {"cached_tokens": 32}   # 2 prompts, n=2 shares each prompt
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True}}
        events = parse_sse(client.post("/v1/chat/completions", json=chat).text)
        assert events[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    finally:
        engine.cached_prompt_tokens = 0


def test_stop_strings_are_not_matched_in_the_first_min_tokens(client_and_engine, tokenizer):
    client, _ = client_and_engine
    script = tokenizer.encode(SCRIPT_TEXT)
    head = tokenizer.decode(script[:3])
    assert "quick" in head            # " The quick brown": the stop string lies in the first 3 tokens
    body = {"prompt": "x", "max_tokens": 8, "stop": ["quick"], "temperature": 0}
    cut = client.post("/v1/completions", json=body).json()["choices"][0]
    assert (cut["text"], cut["finish_reason"]) == (" The ", "stop")
    whole = client.post("/v1/completions", json={**body, "min_tokens": 3}).json()["choices"][0]
    assert (whole["text"], whole["finish_reason"]) == (tokenizer.decode(script[:8]), "length")


def test_stop_string_aborts_engine_request_and_cuts_text(client_and_engine):
    client, engine = client_and_engine
    response = client.post("/v1/completions", json={"prompt": "Say:", "max_tokens": 30, "stop": ["fox"]})
    choice = response.json()["choices"][0]
    assert choice == {"index": 0, "text": " The quick brown ", "logprobs": None, "finish_reason": "stop",
                      "stop_reason": "fox"}   # vLLM's: the stop string that matched
    assert engine.calls[-1][0] in engine.aborted


def test_streaming_chunks_and_usage(client_and_engine, tokenizer):
    client, _ = client_and_engine
    body = {"prompt": "Say:", "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True},
            "stop": [" over"]}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(response.read().decode())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == " The quick brown fox jumps"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_chat_stream_n2_logprobs(client_and_engine):
    client, _ = client_and_engine
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2, "stream": True,
            "logprobs": True, "top_logprobs": 2}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        events = parse_sse(response.read().decode())
    chunks = events[:-1]
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks[2:] if c["choices"][0]["index"] == index]
        assert mine[-1]["finish_reason"] == "length"
        tokens = [e for c in mine for e in c["logprobs"]["content"]]
        assert len(tokens) == 3 and all(len(t["top_logprobs"]) == 2 for t in tokens)
        assert [t["logprob"] for t in tokens] == [-0.5, -1.0, -1.5]


def test_completion_logprobs_and_echo(client_and_engine, tokenizer):
    client, _ = client_and_engine
    body = client.post("/v1/completions", json={"prompt": "Say:", "max_tokens": 2, "logprobs": 1}).json()
    logprobs = body["choices"][0]["logprobs"]
    script = tokenizer.encode(SCRIPT_TEXT)
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in script[:2]]
    assert logprobs["token_logprobs"] == [-0.5, -1.0]
    assert logprobs["text_offset"] == [0, len(logprobs["tokens"][0])]
    echoed = client.post("/v1/completions", json={"prompt": "Say:", "max_tokens": 2, "echo": True}).json()
    assert echoed["choices"][0]["text"] == "Say:" + tokenizer.decode(script[:2])


def _echo_logprobs_of(body: dict, stream: bool) -> dict:
    """The choice-0 legacy logprobs of a completion (a stream's chunks joined)."""
    if not stream:
        return body["choices"][0]["logprobs"]
    joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in body:
        for key in joined:
            joined[key] += chunk["choices"][0]["logprobs"][key]
    return joined


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_leads_with_the_prompt_tokens(client_and_engine, tokenizer, stream):
    client, engine = client_and_engine
    prompt = "Say it:"
    prompt_ids = tokenizer.encode(prompt)
    script = tokenizer.encode(SCRIPT_TEXT)
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "echo": True,
                                                    "logprobs": 2, "stream": stream})
    assert response.status_code == 200, response.text
    assert engine.calls[-1][2].prompt_logprobs == 2 and engine.calls[-1][2].logprobs == 2
    body = [e for e in parse_sse(response.text) if e != "[DONE]"] if stream else response.json()
    logprobs = _echo_logprobs_of(body, stream)
    n = len(prompt_ids)
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in prompt_ids + script[:2]]
    assert logprobs["token_logprobs"] == [None] + [-0.25 * i for i in range(1, n)] + [-0.5, -1.0]
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["top_logprobs"][1] == {tokenizer.decode([prompt_ids[1]]): -0.25,
                                           tokenizer.decode([engine.script[1]]): -1.25}
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets[n] == len(prompt)   # the output's first token follows the prompt
    assert offsets == sorted(offsets)


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_logprobs_in_vllm_shape(client_and_engine, tokenizer, stream):
    client, _ = client_and_engine
    prompt_ids = tokenizer.encode("Say it:")
    body = {"prompt": [prompt_ids, prompt_ids[:2]], "max_tokens": 1, "n": 2, "prompt_logprobs": 1, "stream": stream}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        choices = [e["choices"][0] for e in parse_sse(response.text) if e != "[DONE]" and e["choices"]]
        firsts = {}
        for choice in choices:   # sent once per choice, with its first chunk
            if choice.get("prompt_logprobs") is not None:
                assert choice["index"] not in firsts
                firsts[choice["index"]] = choice["prompt_logprobs"]
    else:
        firsts = {c["index"]: c["prompt_logprobs"] for c in response.json()["choices"]}
    assert sorted(firsts) == [0, 1, 2, 3]   # 2 prompts x n=2
    for index, ids in ((0, prompt_ids), (1, prompt_ids), (2, prompt_ids[:2]), (3, prompt_ids[:2])):
        entries = firsts[index]
        assert len(entries) == len(ids) and entries[0] is None
        for i, (entry, token) in enumerate(zip(entries[1:], ids[1:]), start=1):
            assert entry == {str(token): {"logprob": -0.25 * i, "rank": i, "decoded_token": tokenizer.decode([token])}}


def test_completion_without_prompt_logprobs_asks_for_none(client_and_engine):
    client, engine = client_and_engine
    body = client.post("/v1/completions", json={"prompt": "Say:", "max_tokens": 1, "logprobs": 1}).json()
    assert engine.calls[-1][2].prompt_logprobs is None and "prompt_logprobs" not in body["choices"][0]


def test_echo_of_a_token_id_prompt_shows_its_text(client_and_engine, tokenizer):
    client, _ = client_and_engine
    script = tokenizer.encode(SCRIPT_TEXT)
    prompt_ids = tokenizer.encode("Say it:")
    for stream in (False, True):
        body = {"prompt": prompt_ids, "max_tokens": 2, "echo": True, "stream": stream}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        if stream:
            text = "".join(e["choices"][0]["text"] for e in parse_sse(response.text) if e != "[DONE]")
        else:
            text = response.json()["choices"][0]["text"]
        assert text == "Say it:" + tokenizer.decode(script[:2])


def test_batch_prompts_index_choices(client_and_engine):
    client, _ = client_and_engine
    body = client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2, "n": 2}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["finish_reason"] == "length" for c in body["choices"])


def test_api_key_required_except_health(tokenizer):
    client, engine = make_client(tokenizer, api_key="sekret")
    ok = {"prompt": "x", "max_tokens": 1}
    assert_openai_error(client.post("/v1/completions", json=ok), 401, None)
    assert_openai_error(client.post("/v1/completions", json=ok, headers={"Authorization": "Bearer nope"}),
                        401, None)
    assert_openai_error(client.get("/v1/models"), 401, None)
    assert_openai_error(client.get("/metrics"), 401, None)
    assert engine.calls == []
    assert client.get("/health").status_code == 200
    good = client.post("/v1/completions", json=ok, headers={"Authorization": "Bearer sekret"})
    assert good.status_code == 200


def test_oversized_body_is_413(tokenizer):
    client, engine = make_client(tokenizer, max_body_bytes=1000)
    response = client.post("/v1/completions", json={"prompt": "x" * 2000, "max_tokens": 1})
    assert_openai_error(response, 413, None)
    assert engine.calls == []


@pytest.mark.parametrize("exc, status", [(queue_full(), 429), (EngineDrainingError("draining"), 503)])
@pytest.mark.parametrize("stream", [False, True])
def test_overload_maps_to_status(tokenizer, exc, status, stream):
    engine = ScriptedEngine([5], reject_with=exc)
    client, _ = make_client(tokenizer, engine=engine)
    response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "stream": stream})
    assert_openai_error(response, status, None)
    if status == 429:
        assert response.headers["retry-after"] == "1"


def test_health_reports_dead_engine(tokenizer):
    engine = ScriptedEngine([5])
    client, _ = make_client(tokenizer, engine=engine)
    assert client.get("/health").status_code == 200
    engine.dead = True
    response = client.get("/health")
    assert response.status_code == 503 and "rank 1 is dead" in response.json()["reason"]


def test_models_and_unknown_route(client_and_engine):
    client, _ = client_and_engine
    assert client.get("/v1/models").json()["data"][0]["id"] == MODEL
    assert_openai_error(client.get("/v1/nothing"), 404, None)


def test_fields_that_ask_for_nothing_and_unknown_fields_are_accepted(client_and_engine):
    client, engine = client_and_engine
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for extra in ({"response_format": {"type": "text"}}, {"tool_choice": "none", "tools": []},
                  {"parallel_tool_calls": False}, {"store": False, "metadata": {"k": "v"}, "user": "u"},
                  {"service_tier": "auto", "modalities": ["text"]}, {"some_future_field": {"x": 1}}):
        response = client.post("/v1/chat/completions", json={**chat, **extra})
        assert response.status_code == 200, (extra, response.text)
    completion = {"prompt": "x", "max_tokens": 2, "min_tokens": 0, "logit_bias": {}, "add_special_tokens": True}
    assert client.post("/v1/completions", json=completion).status_code == 200


def test_add_generation_prompt_false_renders_without_the_assistant_header(client_and_engine, tokenizer):
    client, engine = client_and_engine
    messages = [{"role": "user", "content": "hi"}]
    body = {"messages": messages, "max_tokens": 1, "add_generation_prompt": False}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert engine.calls[-1][1] == tokenizer.encode(rendered, add_special_tokens=False)
    with_header = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered != with_header


def test_structured_output_fields_become_a_checked_grammar(client_and_engine):
    client, engine = client_and_engine
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    cases = [("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema",
                                                                    "json_schema": {"name": "s", "schema": schema}}}),
             ("/v1/chat/completions", {**chat, "response_format": {"type": "json_object"}}),
             ("/v1/completions", {"prompt": "x", "max_tokens": 2, "structured_outputs": {"choice": ["yes", "no"]}}),
             ("/v1/completions", {"prompt": "x", "max_tokens": 2, "structured_outputs": {"regex": "[0-9]+"}}),
             ("/v1/completions", {"prompt": "x", "max_tokens": 2, "structured_outputs": {"json": json.dumps(schema)}})]
    grammars = []
    for path, body in cases:
        response = client.post(path, json=body)
        assert response.status_code == 200, (body, response.text)
        grammars.append(engine.calls[-1][2].grammar)
    assert all(isinstance(g, str) and g for g in grammars) and len(set(grammars[:4])) == 4
    assert grammars[4] == grammars[0]   # the same schema through structured_outputs.json (a JSON string)
    assert '"a"' in grammars[0] and "yes" in grammars[2]
    assert client.post(path, json={"prompt": "x", "max_tokens": 2}).status_code == 200
    assert engine.calls[-1][2].grammar is None   # no field, no grammar


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: 'a'"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 1}, "min_tokens"),
])
def test_bad_structured_output_requests_are_400(client_and_engine, extra, param):
    client, engine = client_and_engine
    calls = len(engine.calls)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    assert_openai_error(client.post("/v1/chat/completions", json=body), 400, param)
    assert len(engine.calls) == calls


def test_model_by_id(client_and_engine):
    client, _ = client_and_engine
    card = client.get(f"/v1/models/{MODEL}").json()
    assert (card["id"], card["object"], card["max_model_len"]) == (MODEL, "model", MAX_MODEL_LEN)
    assert client.get("/v1/models/default").json()["id"] == MODEL   # an alias names the same model
    response = client.get("/v1/models/other-model")
    assert_openai_error(response, 404, "model")
    assert response.json()["error"]["code"] == "model_not_found"


def test_tokenize_and_detokenize(client_and_engine, tokenizer):
    client, engine = client_and_engine
    calls = len(engine.calls)
    body = client.post("/tokenize", json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True}).json()
    assert body["tokens"] == tokenizer.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN
    messages = [{"role": "user", "content": "hi"}]
    chat = client.post("/tokenize", json={"messages": messages}).json()
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False) and chat["token_strs"] is None
    back = client.post("/detokenize", json={"tokens": chat["tokens"]}).json()
    assert back == {"prompt": rendered}
    assert_openai_error(client.post("/detokenize", json={"tokens": [VOCAB]}), 400, "tokens")
    assert_openai_error(client.post("/tokenize", json={"prompt": 5}), 400, "prompt")
    assert_openai_error(client.post("/tokenize", json={"prompt": "x", "model": "nope"}), 404, "model")
    assert len(engine.calls) == calls   # the engine is never involved


def test_metrics_text_counts_outcomes(tokenizer):
    client, _ = make_client(tokenizer)
    client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
    client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
    text = client.get("/metrics").text
    m = f'model_name="{MODEL}"'
    assert f'pagedray:requests_total{{endpoint="completions",{m},outcome="length"}} 1.0' in text
    assert f'pagedray:requests_total{{endpoint="completions",{m},outcome="invalid"}} 1.0' in text
    assert f"pagedray:generation_tokens_total{{{m}}} 3.0" in text
    assert f"pagedray:time_to_first_token_seconds_count{{{m}}} 1.0" in text
    assert f"pagedray:inter_token_latency_seconds_count{{{m}}} 2.0" in text
    assert f'pagedray:num_requests_running{{{m},replica="fake-replica"}} 0.0' in text
    assert f'pagedray:engine_healthy{{{m},replica="fake-replica"}} 1.0' in text


def test_sampling_fields_reach_the_engine_unchanged(client_and_engine, tokenizer):
    client, engine = client_and_engine
    body = {"prompt": [11, 22, 33], "max_tokens": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05,
            "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "seed": 7,
            "stop_token_ids": [99], "ignore_eos": True, "n": 2, "logprobs": 2, "min_tokens": 2,
            "logit_bias": {"50": -100, "7": 2.5}, "speculative": False}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    _, prompt_ids, params = engine.calls[-1]
    assert prompt_ids == [11, 22, 33]
    assert response.json()["usage"]["prompt_tokens"] == 3
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.min_p) == (3, 0.7, 0.9, 5, 0.05)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (params.seed, params.stop_token_ids, params.ignore_eos, params.n, params.logprobs) == (7, (99,), True, 2, 2)
    assert (params.min_tokens, params.logit_bias, params.speculative) == (2, ((50, -100.0), (7, 2.5)), False)
    client.post("/v1/completions", json={"prompt": [11], "max_tokens": 1})
    assert engine.calls[-1][2].speculative is True                       # the default: speculation allowed
    bad = client.post("/v1/completions", json={"prompt": [11], "max_tokens": 1, "speculative": "no"})
    assert bad.status_code == 400 and "speculative" in bad.text


def test_chat_prompt_is_the_rendered_template(client_and_engine, tokenizer):
    client, engine = client_and_engine
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).status_code == 200
    rendered = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "hi"}],
                                             add_generation_prompt=True, tokenize=False)
    assert engine.calls[-1][1] == tokenizer.encode(rendered, add_special_tokens=False)
    assert engine.calls[-1][2].max_tokens == 1


def test_health_answers_while_a_prompt_is_being_tokenized(tokenizer):
    gated = GatedTokenizer(tokenizer)
    engine = ScriptedEngine(tokenizer.encode(SCRIPT_TEXT), eos_token_id=tokenizer.eos_token_id)
    limits = ModelLimits(MODEL, frozenset({MODEL, "default"}), VOCAB, MAX_MODEL_LEN)
    app = create_api(OpenAIService(engine, gated, limits, ServerMetrics(MODEL)))

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            slow = asyncio.create_task(client.post("/v1/completions", json={"prompt": "SLOW one", "max_tokens": 2}))
            await asyncio.to_thread(gated.entered.wait, 600)
            health = await client.get("/health")   # answered while the tokenizer still holds the prompt
            gated.release.set()
            return health, await slow

    health, slow = asyncio.run(scenario())
    assert gated.on_event_loop == [False]
    assert health.status_code == 200 and slow.status_code == 200, slow.text


def test_prompt_that_cannot_fit_is_refused_before_tokenizing(tokenizer):
    from pagedray.deploy.openai.prompt_bound import max_prompt_chars

    bound = max_prompt_chars(tokenizer, MAX_MODEL_LEN)
    assert bound is not None and bound >= MAX_MODEL_LEN
    gated = GatedTokenizer(tokenizer)
    limits = ModelLimits(MODEL, frozenset({MODEL, "default"}), VOCAB, MAX_MODEL_LEN, bound)
    client = TestClient(create_api(OpenAIService(ScriptedEngine([5]), gated, limits, ServerMetrics(MODEL))))
    huge = "SLOW" + "x" * bound
    assert_openai_error(client.post("/v1/completions", json={"prompt": huge}), 400, "prompt")
    assert_openai_error(client.post("/v1/completions", json={"prompt": ["ok", huge]}), 400, "prompt")
    chat = {"messages": [{"role": "user", "content": huge}]}
    assert_openai_error(client.post("/v1/chat/completions", json=chat), 400, "messages")
    assert gated.on_event_loop == []   # the tokenizer never saw it
    # the bound is sound: text right at it still tokenizes to more than the context
    assert len(tokenizer.encode("x" * bound)) > MAX_MODEL_LEN


def test_logprobs_of_partial_character_tokens(tokenizer):
    """An emoji split over several tokens: each token is reported by its own bytes (no "\\ufffd"),
    top_logprobs keep one entry per distinct token, text_offset points into the returned text."""
    script = tokenizer.encode("Go 🚀 now 🌊!")
    assert any("\ufffd" in tokenizer.decode([t]) for t in script)   # the case exists in this vocab
    client, _ = make_client(tokenizer, ScriptedEngine(script, eos_token_id=tokenizer.eos_token_id))
    body = {"prompt": "x", "max_tokens": len(script), "logprobs": 2}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    logprobs, text = choice["logprobs"], choice["text"]
    assert text == "Go 🚀 now 🌊!"
    assert all("\ufffd" not in token for token in logprobs["tokens"])
    assert any(token.startswith("bytes:") for token in logprobs["tokens"])
    assert all(len(top) == 2 for top in logprobs["top_logprobs"])
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(text)
    for token, offset in zip(logprobs["tokens"], offsets):
        if not token.startswith("bytes:"):
            assert text[offset:offset + len(token)] == token
    stream = client.post("/v1/completions", json={**body, "stream": True})
    events = [e for e in parse_sse(stream.text) if e != "[DONE]" and e["choices"]]
    assert [o for e in events if e["choices"][0]["logprobs"] for o in e["choices"][0]["logprobs"]["text_offset"]] \
        == offsets
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                     "max_tokens": len(script), "logprobs": True,
                                                     "top_logprobs": 2}).json()["choices"][0]
    content = chat["logprobs"]["content"]
    assert bytes(b for entry in content for b in entry["bytes"]).decode("utf-8") == chat["message"]["content"]
    assert all(len({t["token"] for t in entry["top_logprobs"]}) == 2 for entry in content)


def test_no_redirect_built_from_the_host_header(tokenizer):
    client, _ = make_client(tokenizer, api_key="sekret")
    for path in ("/v1/models/", "/v1/completions/", "/health/"):
        response = client.get(path, headers={"Host": "evil.example.com", "Authorization": "Bearer sekret"},
                              follow_redirects=False)
        assert "location" not in response.headers
        assert_openai_error(response, 404, None)


def test_a_batch_request_keeps_a_bounded_number_of_prompts_in_the_engine(tokenizer):
    """48 prompts x n=4 with sequences_in_flight 64 (what the ingress sets for max_num_seqs 128): at most
    64 // 4 = 16 prompts are in the engine at once, and a short request from another client is served
    while the batch is still held there."""
    from dataclasses import dataclass, field

    @dataclass
    class GatedBatchEngine(ScriptedEngine):
        gate: asyncio.Event = field(default_factory=asyncio.Event)
        batch_in_flight: int = 0
        most_in_flight: int = 0

        async def generate(self, request_id, prompt_token_ids, params, lora=None, session=None, tenant=None):
            batch = params.max_tokens == 3          # the batch request's prompts wait for the gate
            if batch:
                self.batch_in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.batch_in_flight)
                await self.gate.wait()
            try:
                async for out in super().generate(request_id, prompt_token_ids, params):
                    yield out
            finally:
                if batch:
                    self.batch_in_flight -= 1

    engine = GatedBatchEngine(tokenizer.encode(SCRIPT_TEXT), eos_token_id=tokenizer.eos_token_id)
    limits = ModelLimits(MODEL, frozenset({MODEL, "default"}), VOCAB, MAX_MODEL_LEN, sequences_in_flight=64)
    app = create_api(OpenAIService(engine, tokenizer, limits, ServerMetrics(MODEL)))
    window = 64 // 4

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            batch = asyncio.create_task(client.post("/v1/completions", json={
                "prompt": [[7]] * 48, "n": 4, "max_tokens": 3}))
            while engine.batch_in_flight < window:
                await asyncio.sleep(0)
            for _ in range(20):                      # let the ingress send more, if it were going to
                await asyncio.sleep(0)
            held = engine.batch_in_flight
            short = await client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 1})
            engine.gate.set()
            return held, short, await batch

    held, short, batch = asyncio.run(scenario())
    assert held == window and engine.most_in_flight == window
    assert short.status_code == 200 and batch.status_code == 200, batch.text
    assert len(batch.json()["choices"]) == 48 * 4


def test_stop_reason_names_what_stopped_a_choice(client_and_engine, tokenizer):
    """vLLM's ``stop_reason``: the matched stop string, the stop token id, or None for EOS / other finishes;
    the same on the finishing chunk of a stream, and Anthropic's ``stop_sequence`` reads it."""
    client, _ = client_and_engine
    chat = {"messages": [{"role": "user", "content": "Say:"}], "max_tokens": 30}
    whole = client.post("/v1/chat/completions", json={**chat, "stop": ["fox"]}).json()["choices"][0]
    assert (whole["finish_reason"], whole["stop_reason"]) == ("stop", "fox")
    brown = tokenizer.encode(" brown", add_special_tokens=False)[-1]
    by_id = client.post("/v1/chat/completions", json={**chat, "stop_token_ids": [brown]}).json()["choices"][0]
    assert (by_id["finish_reason"], by_id["stop_reason"]) == ("stop", brown)
    length = client.post("/v1/chat/completions", json={**chat, "max_tokens": 2}).json()["choices"][0]
    assert (length["finish_reason"], length["stop_reason"]) == ("length", None)
    events = [e for e in parse_sse(client.post("/v1/chat/completions", json={**chat, "stop": ["fox"], "stream": True})
                                   .text) if e != "[DONE]"]
    finishing = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert [(c["finish_reason"], c["stop_reason"]) for c in finishing] == [("stop", "fox")]
    assert all(e["choices"][0]["stop_reason"] is None for e in events
               if e["choices"] and e["choices"][0]["finish_reason"] is None)
    message = client.post("/v1/messages", json={"messages": chat["messages"], "max_tokens": 30,
                                                "stop_sequences": ["fox"]}).json()
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "fox")


def test_the_model_name_chooses_a_lora_adapter_and_models_lists_them(tokenizer):
    from pagedray.workers.contract.lora_request import LoRARequest

    engine = ScriptedEngine(tokenizer.encode(SCRIPT_TEXT), eos_token_id=tokenizer.eos_token_id)
    limits = ModelLimits(MODEL, frozenset({MODEL, "default"}), VOCAB, MAX_MODEL_LEN,
                         lora_adapters=(("sql", "/adapters/sql"), ("chat", "/adapters/chat")))
    client = TestClient(create_api(OpenAIService(engine, tokenizer, limits, ServerMetrics(MODEL))))
    sql, chat = LoRARequest("sql", "/adapters/sql"), LoRARequest("chat", "/adapters/chat")
    for model, expected in [(MODEL, None), ("sql", sql), (f"{MODEL}:chat", chat), ("default:sql", sql)]:
        response = client.post("/v1/completions", json={"model": model, "prompt": "Say:", "max_tokens": 2})
        assert response.status_code == 200, response.text
        assert engine.loras[-1] == expected
        assert response.json()["model"] == (MODEL if expected is None else expected.name)
    response = client.post("/v1/chat/completions", json={"model": "chat", "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200 and engine.loras[-1] == chat and response.json()["model"] == "chat"
    calls = len(engine.calls)
    for model in ("nope", f"{MODEL}:nope", "sql:chat"):
        response = client.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2})
        assert_openai_error(response, 404, "model")
        assert "'sql'" in response.json()["error"]["message"]
    assert len(engine.calls) == calls
    cards = client.get("/v1/models").json()["data"]
    assert [(c["id"], c.get("parent"), c.get("root")) for c in cards] == [
        (MODEL, None, None), ("sql", MODEL, "/adapters/sql"), ("chat", MODEL, "/adapters/chat")]
    assert client.get("/v1/models/sql").json()["parent"] == MODEL
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL


def test_adapters_load_and_unload_at_run_time_and_bad_loads_change_nothing(tokenizer):
    from pagedray.workers.contract.lora_request import LoRARequest

    engine = ScriptedEngine(tokenizer.encode(SCRIPT_TEXT), eos_token_id=tokenizer.eos_token_id)
    limits = ModelLimits(MODEL, frozenset({MODEL, "default"}), VOCAB, MAX_MODEL_LEN,
                         lora_adapters=(("sql", "/adapters/sql"),))
    service = OpenAIService(engine, tokenizer, limits, ServerMetrics(MODEL))
    client = TestClient(create_api(service, api_key="k"))
    auth = {"Authorization": "Bearer k"}

    def names() -> list[str]:
        return [card["id"] for card in client.get("/v1/models", headers=auth).json()["data"]]

    def complete(model: str):
        return client.post("/v1/completions", headers=auth, json={"model": model, "prompt": "Say:", "max_tokens": 2})

    assert client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/a/x"}).status_code == 401
    load = client.post("/v1/load_lora_adapter", headers=auth, json={"lora_name": "chat", "lora_path": "/a/chat"})
    assert load.status_code == 200 and "chat" in load.text
    assert names() == [MODEL, "sql", "chat"]
    assert complete("chat").status_code == 200 and engine.loras[-1] == LoRARequest("chat", "/a/chat")
    refused = [({"lora_name": "chat", "lora_path": "/a/other"}, "lora_name", "already loaded"),
               ({"lora_name": "chat", "lora_path": "/a/chat", "load_inplace": True}, "load_inplace", "new folder"),
               ({"lora_name": "b", "lora_path": "/a/bad"}, "lora_path", "rank 99"),
               ({"lora_name": "a:b", "lora_path": "/a/ab"}, "lora_name", "without ':'"),
               ({"lora_name": MODEL, "lora_path": "/a/m"}, "lora_name", "base model"),
               ({"lora_name": "c"}, "lora_path", "Field required"),
               ({"lora_name": "c", "lora_path": ""}, "lora_path", "non-empty")]
    for body, param, message in refused:
        error = assert_openai_error(client.post("/v1/load_lora_adapter", headers=auth, json=body), 400, param)
        assert message in error["message"], error
    assert names() == [MODEL, "sql", "chat"]
    moved = client.post("/v1/load_lora_adapter", headers=auth,
                        json={"lora_name": "chat", "lora_path": "/a/chat2", "load_inplace": True})
    assert moved.status_code == 200
    assert complete("chat").status_code == 200 and engine.loras[-1] == LoRARequest("chat", "/a/chat2")
    unload = client.post("/v1/unload_lora_adapter", headers=auth, json={"lora_name": "sql"})
    assert unload.status_code == 200 and names() == [MODEL, "chat"]
    calls = len(engine.calls)
    assert_openai_error(complete("sql"), 404, "model")
    assert_openai_error(client.post("/v1/unload_lora_adapter", headers=auth, json={"lora_name": "sql"}), 404,
                        "lora_name")
    assert len(engine.calls) == calls
    service.lora_refusal = "lora_name: not here"
    assert_openai_error(client.post("/v1/load_lora_adapter", headers=auth, json={"lora_name": "d", "lora_path": "/d"}),
                        400, "lora_name")
    assert names() == [MODEL, "chat"]


def test_prompt_cache_key_or_an_x_session_id_header_names_the_requests_session(tokenizer):
    client, engine = make_client(tokenizer)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [("/v1/completions", {"prompt": "Say:", "max_tokens": 2, "prompt_cache_key": "s1"}, {}, "s1"),
             ("/v1/chat/completions", chat, {"X-Session-Id": "s2"}, "s2"),
             ("/v1/chat/completions", {**chat, "prompt_cache_key": "s3"}, {"X-Session-Id": "s2"}, "s3"),
             ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "prompt_cache_key": "s4"}, {}, "s4"),
             ("/v1/responses", {"input": "hi", "max_output_tokens": 2}, {"X-Session-Id": "s5"}, "s5"),
             ("/v1/completions", {"prompt": "Say:", "max_tokens": 2}, {}, None)]
    for path, body, headers, session in cases:
        response = client.post(path, json=body, headers=headers)
        assert response.status_code == 200, response.text
        assert engine.sessions[-1] == session, (path, body, headers)
    calls = len(engine.calls)
    for key in ("x" * 257, "", 5):
        response = client.post("/v1/completions", json={"prompt": "Say:", "max_tokens": 2, "prompt_cache_key": key})
        assert_openai_error(response, 400, "prompt_cache_key")
    for header in ("x" * 257, ""):
        response = client.post("/v1/completions", json={"prompt": "Say:", "max_tokens": 2},
                               headers={"X-Session-Id": header})
        assert_openai_error(response, 400, "X-Session-Id")
    assert len(engine.calls) == calls
