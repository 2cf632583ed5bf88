"""POST /v1/responses: request translation and its 400s, the Response object and the event stream built
from hand-made chat results (reasoning_content, tool calls in pieces), checked against the official
``openai`` client's models; and the client end to end over the chat path with the scripted TEST DOUBLE
engine."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from fastapi.testclient import TestClient
from helpers.canned_chat import REASONED_CALLS, CannedChat, chat_response, chunk, tool_call
from helpers.fake_engine import ScriptedEngine
from openai.types.responses import Response, ResponseStreamEvent
from pagedray.deploy.bridges.responses_api import from_chat, to_chat
from pagedray.deploy.bridges.responses_stream import response_events
from pagedray.deploy.http.routes import create_api
from pagedray.deploy.openai.errors import APIError
from pagedray.deploy.openai.metrics import ServerMetrics
from pagedray.deploy.openai.service import OpenAIService
from pagedray.deploy.openai.validation import ModelLimits
from pydantic import TypeAdapter

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}
EVENT = TypeAdapter(ResponseStreamEvent)


# ---------------------------------------------------------------- request translation
def test_a_full_request_becomes_the_chat_body():
    body = {"model": "m", "instructions": "Be brief.", "max_output_tokens": 50, "temperature": 0.5, "top_p": 0.9,
            "user": "u1", "metadata": {"k": "v"}, "tools": [WEATHER, TIME], "tool_choice": {"type": "function",
            "name": "get_time"}, "parallel_tool_calls": False, "reasoning": {"effort": "none"}, "store": False,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": False}},
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                   {"type": "input_text", "text": "in Oslo?"}]},
                      {"type": "reasoning", "id": "rs_1", "summary": []},
                      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me"
                                                                            " look.", "annotations": []}]},
                      {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
                      {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                      {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text",
                                                                                    "text": "12:00"}]}]}
    call = to_chat(body)
    chat = call.chat_body
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "12:00"}]
    assert chat["tools"][0] == {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description",
                                                                                       "parameters")}}
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_time"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                                                              "strict": False}}
    assert (chat["max_tokens"], chat["temperature"], chat["top_p"], chat["user"]) == (50, 0.5, 0.9, "u1")
    assert chat["chat_template_kwargs"] == {"enable_thinking": False} and chat["parallel_tool_calls"] is False
    assert "stream" not in chat and not call.stream and call.echo["metadata"] == {"k": "v"}
    streamed = to_chat({"input": "hi", "stream": True, "reasoning": {"effort": "high"}})
    assert streamed.chat_body == {"messages": [{"role": "user", "content": "hi"}], "stream": True,
                                  "stream_options": {"include_usage": True},
                                  "chat_template_kwargs": {"enable_thinking": True}}


@pytest.mark.parametrize("extra, param", [
    ({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"), ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"), ({"top_logprobs": 3}, "top_logprobs"), ({"frobnicate": 1}, "frobnicate"),
    ({"top_k": 5}, "top_k"), ({"stream": "yes"}, "stream"), ({"instructions": 5}, "instructions"),
    ({"input": []}, "input"), ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                               "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"), ({"input": [{"role": "tool", "content": "x"}]},
                                                                     "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools"), ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools"),
    ({"tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ({"text": {"format": {"type": "grammar"}}}, "text"), ({"text": {"verbosity": "low"}}, "text"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning"), ({"reasoning": {"summary": "detailed"}}, "reasoning"),
    ({"metadata": "x"}, "metadata"),
])
def test_unsupported_or_malformed_fields_are_400s_naming_them(extra, param):
    with pytest.raises(APIError) as info:
        to_chat({"input": "hi", **extra})
    assert (info.value.status, info.value.param) == (400, param)
    assert info.value.message.startswith(param)


def test_fields_that_ask_for_nothing_are_accepted():
    call = to_chat({"input": "hi", "store": False, "truncation": "disabled", "include": [], "service_tier": "auto",
                    "prompt_cache_key": "k", "safety_identifier": "s", "top_logprobs": 0, "previous_response_id": None,
                    "reasoning": {"effort": None, "summary": "auto"}, "text": {"format": {"type": "text"}}})
    assert call.chat_body == {"messages": [{"role": "user", "content": "hi"}], "prompt_cache_key": "k"}   # a session
    with pytest.raises(APIError) as info:
        to_chat({"model": "m"})
    assert info.value.param == "input"


# ---------------------------------------------------------------- the Response object
def test_a_chat_response_with_reasoning_and_calls_becomes_output_items():
    chat = chat_response("Checking.", "The user wants the weather.",
                         [tool_call("call_a", "get_weather", '{"city": "Oslo"}')], "tool_calls")
    response = from_chat(chat, to_chat({"input": "hi", "tools": [WEATHER], "metadata": {"k": "v"}}))
    parsed = Response.model_validate(response)    # the official model, strictly
    reasoning, message, call = parsed.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "The user wants the weather."
    assert message.type == "message" and parsed.output_text == "Checking."
    assert (call.type, call.call_id, call.name, call.arguments) == ("function_call", "call_a", "get_weather",
                                                                     '{"city": "Oslo"}')
    assert parsed.status == "completed" and parsed.id.startswith("resp_") and parsed.metadata == {"k": "v"}
    assert (parsed.usage.input_tokens, parsed.usage.output_tokens, parsed.usage.total_tokens) == (20, 12, 32)
    assert parsed.usage.input_tokens_details.cached_tokens == 4
    assert parsed.usage.output_tokens_details.reasoning_tokens == 5
    cut = Response.model_validate(from_chat(chat_response("Check", finish="length"), to_chat({"input": "hi"})))
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete" and len(cut.output) == 1


# ---------------------------------------------------------------- the stream
async def _events(chunks, fail_after=None):
    canned = CannedChat(chunks=chunks, fail_after=fail_after)
    stream = await canned.open_chat_stream({})
    events = [event async for event in response_events(stream, to_chat({"input": "hi", "stream": True}))]
    assert stream.closed
    return events


def test_stream_events_for_reasoning_text_and_calls_in_pieces():
    events = asyncio.run(_events(REASONED_CALLS))
    for event in events:
        EVENT.validate_python(event)        # every event is a valid openai ResponseStreamEvent
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == "response.completed"
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert reasoning == "The user wants the weather."
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Checking now."
    arguments = {}
    for e in events:
        if e["type"] == "response.function_call_arguments.delta":
            arguments[e["output_index"]] = arguments.get(e["output_index"], "") + e["delta"]
    assert arguments == {2: '{"city": "Oslo"}', 3: "{}"}
    added = [e["item"] for e in events if e["type"] == "response.output_item.added" and e["item"]["type"] ==
             "function_call"]
    assert [(a["call_id"], a["name"], a["arguments"]) for a in added] == [("call_a", "get_weather", ""),
                                                                          ("call_b", "get_time", "")]
    final = Response.model_validate(events[-1]["response"])
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call", "function_call"]
    assert [(o.call_id, o.arguments) for o in final.output[2:]] == [("call_a", '{"city": "Oslo"}'), ("call_b", "{}")]
    assert final.usage.output_tokens_details.reasoning_tokens == 5
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == events[-1]["response"]["output"]


def test_a_stream_cut_at_the_limit_ends_incomplete_and_a_failure_ends_failed():
    events = asyncio.run(_events([chunk({"content": "Hel"}), chunk({"content": "lo"}, "length")]))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete"
    failed = asyncio.run(_events(REASONED_CALLS, fail_after=4))
    for event in failed:
        EVENT.validate_python(event)
    assert [e["type"] for e in failed[-2:]] == ["error", "response.failed"]
    assert failed[-2]["message"] == "the engine failed this request"
    assert failed[-1]["response"]["error"]["code"] == "server_error"


# ---------------------------------------------------------------- the openai client over HTTP
def _client(service, api_key=None) -> tuple[openai.OpenAI, TestClient]:
    http = TestClient(create_api(service, api_key=api_key))
    return openai.OpenAI(api_key=api_key or "none", base_url="http://testserver/v1", http_client=http), http


def test_the_client_parses_reasoning_and_calls_in_pieces_streamed_and_whole():
    client, _ = _client(CannedChat(chunks=REASONED_CALLS))
    with client.responses.stream(model="fake-model", input="Weather?", tools=[WEATHER, TIME]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.delta" in kinds
    assert final.output_text == "Checking now."
    assert [(o.name, json.loads(o.arguments)) for o in final.output if o.type == "function_call"] == \
        [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    raw = list(client.responses.create(model="fake-model", input="Weather?", stream=True))
    assert raw[0].type == "response.created" and raw[-1].type == "response.completed"
    whole = _client(CannedChat(chat_response("Hi.", "Say hi.")))[0].responses.create(model="fake-model", input="hi")
    assert whole.output_text == "Hi." and whole.output[0].content[0].text == "Say hi."


def _engine_client(tokenizer, text: str, api_key=None):
    """The API over the real chat path and a scripted engine that answers ``text`` and then EOS."""
    engine = ScriptedEngine(tokenizer.encode(text) + [tokenizer.eos_token_id], eos_token_id=tokenizer.eos_token_id)
    limits = ModelLimits("fake-model", frozenset({"fake-model"}), len(tokenizer), 1024)
    client, http = _client(OpenAIService(engine, tokenizer, limits, ServerMetrics("fake-model")), api_key)
    return client, http, engine


def test_the_client_over_the_chat_path_text_stream_and_function_calls(tokenizer):
    client, http, engine = _engine_client(tokenizer, "Hello there.")
    response = client.responses.create(model="fake-model", input="hi", instructions="Be kind.")
    assert response.status == "completed" and response.output_text == "Hello there."
    assert response.usage.output_tokens == len(tokenizer.encode("Hello there.")) + 1
    assert "Be kind." in tokenizer.decode(engine.calls[-1][1])
    with client.responses.stream(model="fake-model", input="hi") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        assert "".join(deltas) == "Hello there." == stream.get_final_response().output_text
    client, _, engine = _engine_client(tokenizer, '<tool_call>{"name": "get_weather", "arguments": {"city": '
                                                  '"Oslo"}}</tool_call>')
    response = client.responses.create(model="fake-model", input="Weather in Oslo?", tools=[WEATHER])
    (call,) = response.output
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Oslo"})
    follow_up = [{"role": "user", "content": "Weather in Oslo?"},
                 {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                 {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    client.responses.create(model="fake-model", input=follow_up, tools=[WEATHER])
    prompt = tokenizer.decode(engine.calls[-1][1])
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in prompt
    assert "sunny, 21 C" in prompt


def test_chat_path_errors_come_back_in_responses_names(tokenizer):
    client, http, engine = _engine_client(tokenizer, "Hi.", api_key="secret")
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="fake-model", input="hi", max_output_tokens=5000)
    error = info.value.body
    assert error["param"] == "max_output_tokens" and error["message"].startswith("max_output_tokens:")
    assert "max_tokens" not in error["message"].replace("max_output_tokens", "")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="other-model", input="hi")
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="fake-model", input="hi", store=True)
    assert info.value.body["param"] == "store"
    assert http.post("/v1/responses", json={"input": "hi"}).status_code == 401
    assert engine.calls == []    # nothing bad reached the engine
