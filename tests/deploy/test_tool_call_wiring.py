"""The tool-call parsers (tool_parsers.py) wired into chat: the ``tool_call_parser`` option and its
auto-detection, each format through the HTTP app (streamed pieces merge to the whole message), a special
token marker that the detokenizer keeps for the parser (Mistral's ``[TOOL_CALLS]``), and the finish reason
``tool_calls`` of a stream that made calls. The engine is the scripted TEST DOUBLE (helpers/fake_engine.py)."""

import copy
import json

import pytest
from fastapi.testclient import TestClient
from helpers.fake_engine import ScriptedEngine
from pagedray.deploy.http.routes import create_api
from pagedray.deploy.openai.metrics import ServerMetrics
from pagedray.deploy.openai.service import OpenAIService
from pagedray.deploy.openai.sse import parse_sse
from pagedray.deploy.openai.tool_parsers import merge_tool_deltas
from pagedray.deploy.openai.tools import resolve_tool_call_parser
from pagedray.deploy.openai.validation import ModelLimits

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
TEMPLATE_WITH_TOOLS = ("{% if tools %}{{ tools | tojson }}{% endif %}"
                       "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]


def test_the_option_and_its_auto_detection(tokenizer):
    tok = copy.deepcopy(tokenizer)
    assert resolve_tool_call_parser("auto", tok) == "hermes"          # no tools in the template: our prompt
    tok.chat_template = TEMPLATE_WITH_TOOLS + "[TOOL_CALLS]"
    assert resolve_tool_call_parser("auto", tok) == "mistral"
    tok.chat_template = TEMPLATE_WITH_TOOLS + "<tool_call>"
    assert resolve_tool_call_parser("auto", tok) == "hermes"
    assert resolve_tool_call_parser("pythonic", tok) == "pythonic"
    with pytest.raises(ValueError, match="tool_call_parser: 'json' is not one of auto, hermes"):
        resolve_tool_call_parser("json", tok)


def _client(tok, token_ids: list[int], parser: str):
    engine = ScriptedEngine(token_ids + [tok.eos_token_id], eos_token_id=tok.eos_token_id)
    limits = ModelLimits("m", frozenset({"m"}), len(tok), 2048)
    service = OpenAIService(engine, tok, limits, ServerMetrics("m"), tool_call_parser=parser)
    return TestClient(create_api(service))


def _whole_and_streamed(client, body) -> tuple[dict, list[dict], str]:
    whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    events = [e for e in parse_sse(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
              if e != "[DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events[1:]]
    return whole, deltas, events[-1]["choices"][0]["finish_reason"]


@pytest.mark.parametrize("parser, text", [
    ("hermes", 'Checking.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
    ("pythonic", '[get_weather(city="Oslo")]'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'),
])
def test_each_format_streams_what_the_whole_message_says(tokenizer, parser, text):
    tok = copy.deepcopy(tokenizer)
    client = _client(tok, tok.encode(text, add_special_tokens=False), parser)
    whole, deltas, finish = _whole_and_streamed(client, {"messages": MESSAGES, "tools": [WEATHER],
                                                         "max_tokens": 200})
    assert whole["finish_reason"] == finish == "tool_calls"
    (call,) = whole["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    content, calls = merge_tool_deltas([d for d in deltas if d])
    assert content == whole["message"]["content"]
    assert [c["function"] for c in calls] == [call["function"]]


def test_a_special_token_marker_reaches_the_parser(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    marker = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    call = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    ids = [marker] + tok.encode(call, add_special_tokens=False)
    body = {"messages": MESSAGES, "tools": [WEATHER], "max_tokens": 200}
    whole, deltas, finish = _whole_and_streamed(_client(tok, ids, "mistral"), body)
    assert finish == "tool_calls" and whole["message"]["content"] is None
    assert json.loads(whole["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    # without tools the request decodes as before: the special token is skipped
    plain = _client(tok, ids, "mistral").post("/v1/chat/completions", json={"messages": MESSAGES,
                                                                            "max_tokens": 200}).json()
    assert plain["choices"][0]["message"]["content"] == call


def test_the_serve_option_is_checked_before_anything_starts():
    from pagedray.deploy.serve.app import parse_args

    assert parse_args({"tool_call_parser": "pythonic"}).tool_call_parser == "pythonic"
    assert parse_args({}).tool_call_parser == "auto"
    with pytest.raises(ValueError, match="tool_call_parser: must be one of auto, hermes, llama3_json"):
        parse_args({"tool_call_parser": "xml"})
