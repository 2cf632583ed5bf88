"""Tool calling: request validation, the prompt of a template without tools, output parsing (auto,
required, named), and the HTTP shapes (whole and streamed) against the scripted TEST DOUBLE engine."""

from __future__ import annotations

import json

import pytest
from bad_requests import assert_openai_error
from fake_engine import ScriptedEngine
from fastapi.testclient import TestClient
from pagedray.deploy.api import create_api
from pagedray.deploy.errors import APIError
from pagedray.deploy.metrics import ServerMetrics
from pagedray.deploy.service import OpenAIService
from pagedray.deploy.sse import parse_sse
from pagedray.deploy.tools import parse_tool_calls, plan_tools, tool_schema, with_tools_prompt
from pagedray.deploy.validation import ModelLimits

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)


def test_plan_validation_names_the_field():
    assert plan_tools(None, None, None) is None and plan_tools([WEATHER], "none", None) is None
    assert plan_tools([WEATHER, TIME], None, None).choice == "auto"
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, False)
    assert (named.choice, named.name, named.parallel) == ("named", "get_time", False)
    for tools, choice, parallel, param in [
            ([{"type": "function"}], None, None, "tools"),
            ([{"type": "function", "function": {"name": "bad name"}}], None, None, "tools"),
            ([WEATHER, WEATHER], None, None, "tools"),
            ([WEATHER], "sometimes", None, "tool_choice"),
            ([WEATHER], {"type": "function", "function": {"name": "nope"}}, None, "tool_choice"),
            (None, "required", None, "tool_choice"),
            ([WEATHER], None, "yes", "parallel_tool_calls")]:
        with pytest.raises(APIError) as info:
            plan_tools(tools, choice, parallel)
        assert info.value.status == 400 and info.value.param == param


def test_required_schema_lists_every_tool_and_parallel_false_allows_one():
    plan = plan_tools([WEATHER, TIME], "required", False)
    schema = tool_schema(plan)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    named = plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert tool_schema(named) == WEATHER["function"]["parameters"]
    assert tool_schema(plan_tools([WEATHER], "auto", None)) is None


def test_auto_parsing_hermes_blocks_llama_json_and_plain_text():
    plan = plan_tools([WEATHER, TIME], "auto", None)
    text = 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n' \
           '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(text, plan)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert parse_tool_calls(text, plan_tools([WEATHER, TIME], "auto", False))[1][0]["function"]["name"] == "get_weather"
    content, calls = parse_tool_calls('{"name": "get_time", "parameters": {"tz": "UTC"}}', plan)   # Llama-3 form
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"tz": "UTC"}
    for plain in ("It is sunny.", '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
                  "<tool_call>not json</tool_call>"):
        assert parse_tool_calls(plain, plan) == (plain, [])


def test_template_without_tools_gets_the_listing_in_the_system_message():
    plan = plan_tools([WEATHER], "auto", None)
    messages = with_tools_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], plan)
    assert messages[0]["content"].startswith("Be brief.\n\n") and '"get_weather"' in messages[0]["content"]
    assert "<tool_call>" in messages[0]["content"] and messages[1:] == [{"role": "user", "content": "hi"}]
    assert with_tools_prompt([{"role": "user", "content": "hi"}], plan)[0]["role"] == "system"


def _client(tokenizer, text):
    """The API over a scripted engine that answers ``text``, with room for the tool listing in the prompt."""
    engine = ScriptedEngine(tokenizer.encode(text), eos_token_id=tokenizer.eos_token_id)
    limits = ModelLimits("fake-model", frozenset({"fake-model"}), len(tokenizer), 1024)
    return TestClient(create_api(OpenAIService(engine, tokenizer, limits, ServerMetrics("fake-model")))), engine


def test_chat_response_carries_tool_calls_and_the_prompt_lists_the_tools(tokenizer):
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    client, engine = _client(tokenizer, text)
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER],
            "max_tokens": len(tokenizer.encode(text))}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "length"   # the script ran out: calls are parsed all the same
    call = choice["message"]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}
    assert choice["message"]["content"] is None
    prompt = tokenizer.decode(engine.calls[-1][1])
    assert '"get_weather"' in prompt and "Weather of a city" in prompt
    assert engine.calls[-1][2].grammar is None   # auto: no grammar
    required = client.post("/v1/chat/completions", json={**body, "tool_choice": "required"})
    assert '"get_weather"' in engine.calls[-1][2].grammar and required.status_code == 200


def test_streamed_tool_calls_arrive_as_one_delta_each(tokenizer):
    text = 'Sure.<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    client, _ = _client(tokenizer, text)
    body = {"messages": [{"role": "user", "content": "Time?"}], "tools": [WEATHER, TIME], "stream": True,
            "max_tokens": len(tokenizer.encode(text))}
    events = [e for e in parse_sse(client.post("/v1/chat/completions", json=body).text) if e != "[DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1] == {"content": "Sure."}
    (call,) = deltas[2]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "get_time", "arguments": "{}"}
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_an_earlier_turns_tool_calls_and_tool_answers_are_rendered(tokenizer):
    client, engine = _client(tokenizer, "It is 12:00.")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    messages = [{"role": "user", "content": "Time?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    body = {"messages": messages, "tools": [TIME], "max_tokens": 3}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    prompt = tokenizer.decode(engine.calls[-1][1])
    assert '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' in prompt and "12:00" in prompt
    assert_openai_error(client.post("/v1/chat/completions", json={**body, "tool_choice": "required",
                                                                   "response_format": {"type": "json_object"}}),
                        400, "tool_choice")
