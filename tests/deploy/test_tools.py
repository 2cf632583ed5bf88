"""Tool calling: request validation, the prompt of a template without tools, output parsing (auto,
required, named), and the HTTP shapes (whole and streamed) against the scripted TEST DOUBLE engine."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from helpers.bad_requests import assert_openai_error
from helpers.fake_engine import ScriptedEngine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pagedray.deploy.http.routes import create_api
from pagedray.deploy.openai.errors import APIError
from pagedray.deploy.openai.metrics import ServerMetrics
from pagedray.deploy.openai.service import OpenAIService
from pagedray.deploy.openai.sse import parse_sse
from pagedray.deploy.openai.tools import (
    calls_as_text,
    parse_tool_calls,
    plan_tools,
    tool_schema,
    tools_system_prompt,
    with_tools_prompt,
)
from pagedray.deploy.openai.validation import ModelLimits

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


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
    assert tool_schema(named) == {**WEATHER["function"]["parameters"], "additionalProperties": False}   # strict
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


def test_streamed_tool_calls_arrive_name_first_then_argument_pieces(tokenizer):
    text = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    client, _ = _client(tokenizer, text)
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER, TIME], "stream": True,
            "max_tokens": len(tokenizer.encode(text))}
    events = [e for e in parse_sse(client.post("/v1/chat/completions", json=body).text) if e != "[DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content") or "" for d in deltas) == "Sure."
    pieces = [call for d in deltas for call in d.get("tool_calls") or []]
    header = pieces[0]
    assert header["index"] == 0 and header["id"].startswith("call_") and header["type"] == "function"
    assert header["function"] == {"name": "get_weather", "arguments": ""}
    assert len(pieces) > 2 and all(set(p) == {"index", "function"} and p["index"] == 0 for p in pieces[1:])
    assert "".join(p["function"]["arguments"] for p in pieces[1:]) == '{"city": "Oslo"}'   # as the model wrote it
    whole = client.post("/v1/chat/completions", json={**body, "stream": False}).json()["choices"][0]["message"]
    assert whole["content"] == "Sure." and whole["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
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


# ---------------------------------------------------------------- malformed structures (issue #32)
DEEP_PARAMETERS = {"type": "object"}
for _ in range(40):
    DEEP_PARAMETERS = {"type": "object", "properties": {"a": DEEP_PARAMETERS}}


@pytest.mark.parametrize("tools, choice, parallel, param", [
    ([WEATHER], {"type": "function", "function": "get_weather"}, None, "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": ["get_weather"]}}, None, "tool_choice"),
    ([WEATHER], {"type": "function"}, None, "tool_choice"),
    ([WEATHER], {"function": {"name": "get_weather"}}, None, "tool_choice"),
    ([WEATHER], ["auto"], None, "tool_choice"),
    (None, {"type": "function", "function": {"name": "get_weather"}}, None, "tool_choice"),
    (["get_weather"], None, None, "tools"),
    ({"type": "function"}, None, None, "tools"),
    ([{"type": "function", "function": "get_weather"}], None, None, "tools"),
    ([{"type": "tool", "function": {"name": "f"}}], None, None, "tools"),
    ([{"type": "function", "function": {"name": 7}}], None, None, "tools"),
    ([{"type": "function", "function": {"name": "f", "description": ["x"]}}], None, None, "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], None, None, "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None, None, "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": DEEP_PARAMETERS}}], None, None, "tools"),
    ([{"type": "function", "function": "f"}], "none", None, "tools"),    # malformed even when not used
    ([WEATHER], "none", 1, "parallel_tool_calls"),
])
def test_malformed_tool_requests_are_400s_naming_the_field(tools, choice, parallel, param):
    with pytest.raises(APIError) as info:
        plan_tools(tools, choice, parallel)
    assert (info.value.status, info.value.param) == (400, param)


@pytest.mark.parametrize("call", [
    "call_1", {"id": "call_1", "type": "function", "function": "get_time"},
    {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {}}},
    {"id": "call_1", "type": "function", "function": {"name": ["get_time"], "arguments": "{}"}},
    {"id": "call_1", "type": "function", "function": {"arguments": "{}"}},
    {"id": "call_1", "type": "custom", "function": {"name": "get_time", "arguments": "{}"}},
    {"id": 5, "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
])
def test_malformed_earlier_tool_calls_are_400s_naming_messages(call):
    with pytest.raises(APIError) as info:
        calls_as_text([call])
    assert (info.value.status, info.value.param) == (400, "messages")


def test_earlier_tool_call_arguments_that_are_not_json_are_written_as_strings():
    deep = "[" * 50_000 + "]" * 50_000
    for arguments in ("not json", deep, '{"x": NaN}'):
        call = {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": arguments}}
        assert calls_as_text([call]) == "<tool_call>" + json.dumps({"name": "get_time", "arguments": arguments}) \
            + "</tool_call>"


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": [1], "arguments": {}}</tool_call>',
    '<tool_call>{"name": {"a": 1}, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": [1, 2]}</tool_call>',
    '<tool_call>["get_time", {}]</tool_call>',
    "<tool_call>" + "[" * 50_000 + "]" * 50_000 + "</tool_call>",
    '{"name": "get_time", "arguments": ' + "[" * 50_000 + "]" * 50_000 + "}",
    "<tool_call>" + " " * 20_000,
    "<tool_call>x" * 20_000,
    '{"name": null}',
], ids=["name_list", "name_object", "arguments_list", "not_an_object", "deep_block", "deep_arguments",
        "unclosed_block_of_spaces", "many_unclosed_blocks", "name_null"])
def test_malformed_model_output_stays_content(text):
    assert parse_tool_calls(text, plan_tools([WEATHER, TIME], "auto", None)) == (text, [])


@pytest.mark.parametrize("choice, text", [
    ("required", '{"name": "get_time", "arguments": {}}'),
    ("required", "[]"),
    ("required", '[{"name": "nope", "arguments": {}}]'),
    ("required", '[{"name": "get_time", "arguments": "{}"}]'),
    ("required", '["get_time"]'),
    ({"type": "function", "function": {"name": "get_time"}}, "[1]"),
    ({"type": "function", "function": {"name": "get_time"}}, "[" * 50_000),
], ids=["required_not_a_list", "required_empty", "required_unknown_name", "required_arguments_string",
        "required_item_string", "named_list", "named_deep"])
def test_constrained_output_that_is_not_calls_stays_content(choice, text):
    assert parse_tool_calls(text, plan_tools([WEATHER, TIME], choice, None)) == (text, [])


@pytest.mark.parametrize("choice, text, content, arguments", [
    ("auto", '<tool_call>{"name": "get_time", "arguments": {"x": NaN}}</tool_call>', None, '{"x": NaN}'),
    ("auto", '<tool_call>{"name": "get_time", "arguments": {"tz": "UT', None, '{"tz": "UT'),
    ("required", '[{"name": "get_time", "arguments": {}}, 5]', "5]", "{}"),
    ({"type": "function", "function": {"name": "get_time"}}, '{"a": Infinity}', None, '{"a": Infinity}'),
    ({"type": "function", "function": {"name": "get_time"}}, '{"tz": "UTC", ', None, '{"tz": "UTC",'),
], ids=["nan", "cut_short", "required_item_number", "named_infinity", "named_cut_short"])
def test_a_committed_call_keeps_the_arguments_as_written(choice, text, content, arguments):
    """Changed with streaming (#35): once a known name and an arguments object were read, the call is sent
    and stays, its arguments the raw text (malformed or cut short by max_tokens); what follows is content."""
    content_out, calls = parse_tool_calls(text, plan_tools([WEATHER, TIME], choice, None))
    assert content_out == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("get_time", arguments)]


def test_required_choice_rebases_each_tools_local_refs(tokenizer):
    city = {"type": "function", "function": {"name": "city", "parameters": {
        "type": "object", "$defs": {"name": {"type": "string", "maxLength": 20}},
        "properties": {"name": {"$ref": "#/$defs/name"}, "twin": {"$ref": "#"}}, "required": ["name"]}}}
    schema = tool_schema(plan_tools([WEATHER, city], "required", None))
    arguments = schema["items"]["anyOf"][1]["properties"]["arguments"]
    assert arguments["properties"]["name"] == {"$ref": "#/items/anyOf/1/properties/arguments/$defs/name"}
    assert arguments["properties"]["twin"] == {"$ref": "#/items/anyOf/1/properties/arguments"}
    text = '[{"name": "city", "arguments": {"name": "Oslo"}}]'
    client, _ = _client(tokenizer, text)
    body = {"messages": [{"role": "user", "content": "A city?"}], "tools": [WEATHER, city],
            "tool_choice": "required", "max_tokens": len(tokenizer.encode(text))}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text   # the grammar check resolved every $ref
    assert response.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "city"


def test_a_malformed_call_in_model_output_is_content_whole_and_streamed(tokenizer):
    text = '<tool_call>{"name": [1], "arguments": {}}</tool_call>'
    client, _ = _client(tokenizer, text)
    body = {"messages": [{"role": "user", "content": "Time?"}], "tools": [TIME],
            "max_tokens": len(tokenizer.encode(text))}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["content"] == text and message["tool_calls"] is None
    events = [e for e in parse_sse(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
              if e != "[DONE]"]
    assert all("error" not in e for e in events)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == text


# ---------------------------------------------------------------- drawn malformed structures
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=3), max_leaves=12)
NAMES = st.sampled_from(["get_weather", "get_time", "bad name", ""]) | JSON_VALUES
FUNCTIONS = st.fixed_dictionaries({}, optional={"name": NAMES, "description": JSON_VALUES,
                                                "parameters": JSON_VALUES | st.just({"type": "object"})})
TOOLS = st.fixed_dictionaries({}, optional={"type": st.just("function") | JSON_VALUES,
                                            "function": FUNCTIONS | JSON_VALUES})
CHOICES = st.sampled_from(["none", "auto", "required", None]) | JSON_VALUES | st.fixed_dictionaries(
    {}, optional={"type": st.just("function") | JSON_VALUES, "function": st.fixed_dictionaries(
        {}, optional={"name": NAMES}) | JSON_VALUES})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tools=st.lists(TOOLS | JSON_VALUES, max_size=3) | JSON_VALUES, choice=CHOICES,
       parallel=st.none() | st.booleans() | JSON_VALUES)
def test_drawn_tool_requests_plan_or_are_400s(tools, choice, parallel):
    try:
        plan = plan_tools(tools, choice, parallel)
    except APIError as exc:
        assert exc.status == 400 and exc.param in ("tools", "tool_choice", "parallel_tool_calls")
        return
    if plan is not None:
        assert all(isinstance(t["name"], str) and isinstance(t.get("parameters", {}), dict) for t in plan.tools)
        assert plan.choice != "named" or plan.name in plan.names
        tools_system_prompt(plan)
        tool_schema(plan)


@settings(max_examples=300, deadline=None)
@given(calls=st.lists(st.fixed_dictionaries({}, optional={
    "id": st.just("call_1") | JSON_VALUES, "type": st.just("function") | JSON_VALUES,
    "function": st.fixed_dictionaries({}, optional={"name": NAMES, "arguments": st.just('{"a": 1}') | JSON_VALUES})
    | JSON_VALUES}) | JSON_VALUES, min_size=1, max_size=3))
def test_drawn_earlier_tool_calls_render_or_are_400s(calls):
    try:
        text = calls_as_text(calls)
    except APIError as exc:
        assert exc.status == 400 and exc.param == "messages"
        return
    assert text.count("<tool_call>") == len(calls)


def _output_parts():
    call = st.fixed_dictionaries({}, optional={"name": NAMES, "arguments": JSON_VALUES, "parameters": JSON_VALUES})
    as_json = (call | JSON_VALUES | st.lists(call, max_size=2)).map(json.dumps)
    return st.lists(as_json | st.sampled_from(["<tool_call>", "</tool_call>", " ", "\n", "NaN", "{", "]", "x"]),
                    max_size=8).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=_output_parts(), choice=st.sampled_from(["auto", "required", "named"]), parallel=st.booleans())
def test_drawn_model_output_parses_without_raising(text, choice, parallel):
    tool_choice = {"type": "function", "function": {"name": "get_time"}} if choice == "named" else choice
    plan = plan_tools([WEATHER, TIME], tool_choice, parallel)
    content, calls = parse_tool_calls(text, plan)
    assert content is None or isinstance(content, str)
    for call in calls:   # arguments are the raw text written, an object's (maybe malformed or cut short)
        assert call["function"]["name"] in plan.names and call["function"]["arguments"].startswith("{")
    assert len(calls) <= 1 or parallel
    assert calls or content == (text or None)   # without calls, all the text is content ("" -> None)
