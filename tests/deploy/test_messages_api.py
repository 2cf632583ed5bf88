"""POST /v1/messages: request translation and its 400s, the Message and the event stream built from
hand-made chat results (reasoning_content, tool calls in pieces), checked against the official
``anthropic`` client's models; errors in Anthropic's shape, x-api-key; and the client end to end over the
chat path with the scripted TEST DOUBLE engine."""

from __future__ import annotations

import asyncio

import anthropic
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from fastapi.testclient import TestClient
from helpers.canned_chat import REASONED_CALLS, CannedChat, chat_response, tool_call
from helpers.fake_engine import ScriptedEngine
from pagedray.deploy.bridges.messages_api import from_chat, to_chat
from pagedray.deploy.bridges.messages_stream import message_events
from pagedray.deploy.http.routes import create_api
from pagedray.deploy.openai.errors import APIError
from pagedray.deploy.openai.metrics import ServerMetrics
from pagedray.deploy.openai.service import OpenAIService
from pagedray.deploy.openai.validation import ModelLimits
from pydantic import TypeAdapter

WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
EVENT = TypeAdapter(RawMessageStreamEvent)
HI = [{"role": "user", "content": "hi"}]


# ---------------------------------------------------------------- request translation
def test_a_full_request_becomes_the_chat_body():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?",
                                      "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                          {"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                      "content": [{"type": "text", "text": "timeout"}]},
                                     {"type": "text", "text": "Try again?"}]}]
    call = to_chat({"model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
                    "messages": messages, "tools": [WEATHER], "tool_choice": {"type": "any",
                                                                              "disable_parallel_tool_use": True},
                    "stop_sequences": ["END"], "temperature": 0.2, "top_p": 0.9, "top_k": 5,
                    "metadata": {"user_id": "u1"}, "thinking": {"type": "enabled", "budget_tokens": 2048}})
    chat = call.chat_body
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: timeout"},
        {"role": "user", "content": "Try again?"}]
    function = {"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER["input_schema"]}
    assert chat["tools"] == [{"type": "function", "function": function}]
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == ("required", False)
    assert (chat["stop"], chat["top_k"], chat["user"], chat["max_tokens"]) == (["END"], 5, "u1", 64)
    assert chat["chat_template_kwargs"] == {"enable_thinking": True} and call.stop_sequences == ("END",)
    prefill = to_chat({"max_tokens": 5, "messages": HI + [{"role": "assistant", "content": "Sure,"}], "stream": True,
                       "thinking": {"type": "disabled"}, "tool_choice": {"type": "tool", "name": "get_weather"},
                       "tools": [WEATHER]}).chat_body
    assert prefill["continue_final_message"] is True and prefill["add_generation_prompt"] is False
    assert prefill["stream_options"] == {"include_usage": True}
    assert prefill["chat_template_kwargs"] == {"enable_thinking": False}
    assert prefill["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("extra, param", [
    ({"max_tokens": None}, "max_tokens"), ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]},
     "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                  "content": [{"type": "image"}]}]}]}, "messages"),
    ({"system": [{"type": "image"}]}, "system"), ({"tools": [{"type": "web_search_20250305", "name": "w"}]}, "tools"),
    ({"tools": [{**WEATHER, "input_examples": [{"city": "x"}]}]}, "tools"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice"), ({"thinking": {"type": "enabled"}}, "thinking"),
    ({"thinking": {"type": "max"}}, "thinking"), ({"container": "c1"}, "container"), ({"speed": "fast"}, "speed"),
    ({"output_config": {"effort": "high"}}, "output_config"), ({"stop_sequences": "END"}, "stop_sequences"),
    ({"metadata": {"tier": "gold"}}, "metadata"), ({"frobnicate": 1}, "frobnicate"), ({"stream": 1}, "stream"),
])
def test_unsupported_or_malformed_fields_are_400s_naming_them(extra, param):
    with pytest.raises(APIError) as info:
        to_chat({"max_tokens": 5, "messages": HI, **extra})
    assert (info.value.status, info.value.param) == (400, param)
    assert info.value.message.startswith(param)


# ---------------------------------------------------------------- the Message
def test_a_chat_response_becomes_thinking_text_and_tool_use_blocks():
    chat = chat_response("Checking.", "The user wants the weather.",
                         [tool_call("call_abc", "get_weather", '{"city": "Oslo"}')], "tool_calls")
    message = Message.model_validate(from_chat(chat, to_chat({"max_tokens": 5, "messages": HI})))
    thinking, text, use = message.content
    assert thinking.thinking == "The user wants the weather." and text.text == "Checking."
    assert (use.id, use.name, use.input) == ("toolu_abc", "get_weather", {"city": "Oslo"})
    assert message.stop_reason == "tool_use" and message.id.startswith("msg_")
    use_counts = message.usage
    assert (use_counts.input_tokens, use_counts.cache_read_input_tokens, use_counts.output_tokens) == (16, 4, 12)
    call = to_chat({"max_tokens": 5, "messages": HI, "stop_sequences": ["END"]})
    assert from_chat(chat_response("a", finish="length"), call)["stop_reason"] == "max_tokens"
    assert from_chat(chat_response("a"), call)["stop_reason"] == "end_turn"
    matched = from_chat(chat_response("a", stop_reason="END"), call)     # vLLM's stop_reason, when sent
    assert (matched["stop_reason"], matched["stop_sequence"]) == ("stop_sequence", "END")


# ---------------------------------------------------------------- the stream
async def _events(chunks, fail_after=None):
    canned = CannedChat(chunks=chunks, fail_after=fail_after)
    stream = await canned.open_chat_stream({})
    events = [e async for e in message_events(stream, to_chat({"max_tokens": 5, "messages": HI, "stream": True}))]
    assert stream.closed
    return events


def test_stream_events_for_thinking_text_and_calls_in_pieces():
    events = asyncio.run(_events(REASONED_CALLS))
    for event in events:
        EVENT.validate_python(event)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [(e["index"], e["content_block"]["type"]) for e in starts] == \
        [(0, "thinking"), (1, "text"), (2, "tool_use"), (3, "tool_use")]
    assert [e["content_block"].get("id") for e in starts[2:]] == ["toolu_a", "toolu_b"]
    # blocks one at a time: each stops before the next starts
    assert [e["index"] for e in events if e["type"] in ("content_block_start", "content_block_stop")] == \
        [0, 0, 1, 1, 2, 2, 3, 3]
    json_pieces = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "input_json_delta" and e["index"] == 2]
    assert json_pieces == ['{"city": ', '"Oslo"}']
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"]["input_tokens"] == 16 and events[-2]["usage"]["output_tokens"] == 12
    failed = asyncio.run(_events(REASONED_CALLS, fail_after=4))
    assert failed[-1] == {"type": "error", "error": {"type": "api_error", "message": "the engine failed this request"}}


# ---------------------------------------------------------------- the anthropic client over HTTP
def _client(service, api_key=None) -> tuple[anthropic.Anthropic, TestClient]:
    http = TestClient(create_api(service, api_key=api_key))
    return anthropic.Anthropic(api_key=api_key or "none", base_url="http://testserver", http_client=http), http


def test_the_client_accumulates_thinking_and_tool_inputs_in_pieces():
    client, _ = _client(CannedChat(chunks=REASONED_CALLS))
    with client.messages.stream(model="fake-model", max_tokens=64, messages=HI, tools=[WEATHER]) as stream:
        message = stream.get_final_message()
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert message.content[0].thinking == "The user wants the weather." and message.content[1].text == "Checking now."
    assert [(b.name, b.input) for b in message.content[2:]] == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert message.stop_reason == "tool_use" and message.usage.input_tokens == 16
    client, _ = _client(CannedChat(chunks=REASONED_CALLS, fail_after=4))
    with pytest.raises(anthropic.APIStatusError, match="the engine failed this request"):
        with client.messages.stream(model="fake-model", max_tokens=64, messages=HI) as stream:
            stream.get_final_message()


def _engine_client(tokenizer, text: str, api_key=None):
    engine = ScriptedEngine(tokenizer.encode(text) + [tokenizer.eos_token_id], eos_token_id=tokenizer.eos_token_id)
    limits = ModelLimits("fake-model", frozenset({"fake-model"}), len(tokenizer), 1024)
    client, http = _client(OpenAIService(engine, tokenizer, limits, ServerMetrics("fake-model")), api_key)
    return client, http, engine


def test_the_client_over_the_chat_path_text_stream_and_tool_use(tokenizer):
    client, _, engine = _engine_client(tokenizer, "Hello there.")
    message = client.messages.create(model="fake-model", max_tokens=64, messages=HI, system="Be kind.")
    assert message.content[0].text == "Hello there." and message.stop_reason == "end_turn"
    assert "Be kind." in tokenizer.decode(engine.calls[-1][1])
    with client.messages.stream(model="fake-model", max_tokens=64, messages=HI) as stream:
        assert "".join(stream.text_stream) == "Hello there."
    cut = client.messages.create(model="fake-model", max_tokens=2, messages=HI)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    client, _, engine = _engine_client(tokenizer, '<tool_call>{"name": "get_weather", "arguments": {"city": '
                                                  '"Oslo"}}</tool_call>')
    message = client.messages.create(model="fake-model", max_tokens=64, tools=[WEATHER],
                                     messages=[{"role": "user", "content": "Weather in Oslo?"}])
    (use,) = message.content
    assert (use.type, use.name, use.input, message.stop_reason) == ("tool_use", "get_weather", {"city": "Oslo"},
                                                                    "tool_use")
    client.messages.create(model="fake-model", max_tokens=64, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": message.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]}])
    prompt = tokenizer.decode(engine.calls[-1][1])
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in prompt
    assert "sunny, 21 C" in prompt


def test_errors_in_anthropic_shape_and_the_x_api_key_header(tokenizer):
    client, http, engine = _engine_client(tokenizer, "Hi.", api_key="secret")
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="fake-model", max_tokens=64, messages=HI, stop_sequences=["x"] * 17)
    assert info.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                          "message": info.value.body["error"]["message"]}}
    assert info.value.body["error"]["message"].startswith("stop_sequences:")
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="claude-x", max_tokens=64, messages=HI)
    assert info.value.body["error"]["type"] == "not_found_error"
    body = {"model": "fake-model", "max_tokens": 4, "messages": HI}
    denied = http.post("/v1/messages", json=body, headers={"x-api-key": "wrong"})
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    assert http.post("/v1/messages", json=body, headers={"Authorization": "Bearer secret"}).status_code == 200
    assert http.post("/v1/chat/completions", json={"messages": HI}, headers={"x-api-key": "secret"}).status_code == 401
    malformed = http.post("/v1/messages", content=b"{", headers={"x-api-key": "secret",
                                                                 "Content-Type": "application/json"})
    assert malformed.status_code == 400 and malformed.json()["type"] == "error"
    assert len(engine.calls) == 1     # only the one good request reached the engine
