"""Reasoning output (deploy/openai/reasoning.py): ``<think>...</think>`` becomes ``reasoning_content``.

The splitter is checked on its own (cases and a property: any split of any text streams the same
message as the whole text), then through the HTTP app with the real Qwen3 chat templates
(tests/helpers/templates) over a scripted TEST DOUBLE engine and SmolLM2's tokenizer, where ``<think>``
is several tokens, so the tags always span tokens; then the grammar that waits for the end of the
reasoning, with llguidance itself."""

import copy
import pathlib

import pytest
from fastapi.testclient import TestClient
from helpers.fake_engine import ScriptedEngine
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedray.deploy.http.routes import create_api
from pagedray.deploy.openai.metrics import ServerMetrics
from pagedray.deploy.openai.reasoning import (
    ReasoningStart,
    ReasoningTracker,
    ThinkTags,
    grammar_after_reasoning,
    resolve_reasoning_parser,
    split_text,
)
from pagedray.deploy.openai.service import OpenAIService
from pagedray.deploy.openai.sse import parse_sse
from pagedray.deploy.openai.validation import ModelLimits

TEMPLATES = pathlib.Path(__file__).parent.parent / "helpers" / "templates"
QWEN3 = (TEMPLATES / "qwen3.jinja").read_text()
QWEN3_OPEN = (TEMPLATES / "qwen3_thinking_2507.jinja").read_text()
TAGS = ThinkTags()
CLOSED, OPEN = ReasoningStart(TAGS, False), ReasoningStart(TAGS, True)
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.mark.parametrize("start, text, reasoning, content", [
    (CLOSED, "<think>\nTwo and two.\n</think>\n\nFour.", "Two and two.", "Four."),
    (CLOSED, "  \n<think>x</think>y", "x", "y"),
    (OPEN, "Two and two.\n</think>\n\nFour.", "Two and two.", "Four."),
    (CLOSED, "  Four.\n", None, "  Four.\n"),                  # never thinks: content byte for byte
    (CLOSED, "", None, ""),
    (CLOSED, "<think>\nStill thinking", "Still thinking", None),  # cut by max_tokens
    (OPEN, "Still thinking \n", "Still thinking", None),
    (CLOSED, "<think></think>Four.", None, "Four."),
    (CLOSED, "Four. <think>x</think>", None, "Four. <think>x</think>"),   # a later tag is content
    (CLOSED, "<think>a</think>b<think>c</think>", "a", "b<think>c</think>"),
    (CLOSED, "<thinking>", None, "<thinking>"),
    (CLOSED, "<thi", None, "<thi"),
    (OPEN, "a </thin", "a </thin", None),
])
def test_split_cases(start, text, reasoning, content):
    got = split_text(text, start)
    assert (got.reasoning, got.content) == (reasoning, content)


PIECES = ["<think>", "</think>", "<th", "ink>", "</", "think>", "\n", " ", "\n\n", "a", "bc", "<", ">", "x y"]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=14), st.booleans(), st.data())
def test_any_split_streams_the_whole_message(pieces, opened, data):
    text = "".join(pieces)
    start = ReasoningStart(TAGS, opened)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    tracker = ReasoningTracker(start)
    streamed_reasoning, streamed_content = [], []
    for i, part in enumerate(parts):
        reasoning, content = tracker.feed(part, 1, last=i == len(parts) - 1)
        streamed_reasoning.append(reasoning)
        streamed_content.append(content)
    whole = split_text(text, start)
    assert tracker.message() == whole
    assert "".join(streamed_reasoning) == (whole.reasoning or "")
    assert "".join(streamed_content) == (whole.content or "")
    if whole.reasoning is None and not opened:
        assert whole.content == text or "<think>" in text


def test_reasoning_tokens_count_the_deltas_in_the_block():
    tracker = ReasoningTracker(CLOSED)
    for piece, last in [("<th", False), ("ink>\nhm", False), ("m\n</", False), ("think>", False), ("\n\nFour", False),
                        (".", True)]:
        tracker.feed(piece, 1, last)
    assert tracker.tokens == 4      # "<th" counts once the tag completes; "</" and "think>" too
    assert tracker.message().reasoning == "hmm" and tracker.message().content == "Four."


def test_the_parser_option_and_its_auto_detection():
    assert resolve_reasoning_parser("auto", QWEN3) == TAGS
    assert resolve_reasoning_parser("auto", "{{ messages[0]['content'] }}") is None
    assert resolve_reasoning_parser("auto", None) is None
    assert resolve_reasoning_parser("none", QWEN3) is None
    assert resolve_reasoning_parser("think", None) == TAGS
    assert resolve_reasoning_parser("qwen3", None) == TAGS and resolve_reasoning_parser("deepseek_r1", None) == TAGS
    with pytest.raises(ValueError, match="reasoning_parser: 'r2' is not one of"):
        resolve_reasoning_parser("r2", QWEN3)


def _client(tokenizer, template: str, text: str, parser: str = "auto"):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    script = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]   # the text, then EOS
    engine = ScriptedEngine(script, eos_token_id=tok.eos_token_id)
    limits = ModelLimits("m", frozenset({"m"}), len(tok), 1024)
    service = OpenAIService(engine, tok, limits, ServerMetrics("m"), reasoning_parser=parser)
    return TestClient(create_api(service)), engine, tok


def _stream(client, body) -> list[dict]:
    response = client.post("/v1/chat/completions", json={**body, "stream": True,
                                                          "stream_options": {"include_usage": True}})
    assert response.status_code == 200, response.text
    return [event for event in parse_sse(response.text) if event != "[DONE]"]


THOUGHT = "<think>\nTwo and two make four.\n</think>\n\nThe answer is four."


def test_qwen3_chat_splits_reasoning_whole_and_streamed(tokenizer):
    client, engine, tok = _client(tokenizer, QWEN3, THOUGHT)
    tokens = len(tok.encode(THOUGHT, add_special_tokens=False))
    body = {"messages": MESSAGES, "max_tokens": tokens}
    whole = client.post("/v1/chat/completions", json=body).json()
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] == "Two and two make four."
    assert message["content"] == "The answer is four."
    thinking = len(tok.encode("<think>\nTwo and two make four.\n</think>", add_special_tokens=False))
    details = whole["usage"]["completion_tokens_details"]
    assert thinking - 2 <= details["reasoning_tokens"] <= thinking + 1   # token edges of the tags
    chunks = _stream(client, body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert (reasoning, content) == (message["reasoning_content"], message["content"])
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_content + 1:])   # reasoning, then content
    assert chunks[-1]["usage"]["completion_tokens_details"] == details


def test_thinking_off_renders_the_closed_block_and_answers_as_content(tokenizer):
    client, engine, tok = _client(tokenizer, QWEN3, "The answer is four.")
    body = {"messages": MESSAGES, "max_tokens": 50, "chat_template_kwargs": {"enable_thinking": False}}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    prompt = tok.decode(engine.calls[-1][1])
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert choice["message"]["reasoning_content"] is None
    assert choice["message"]["content"] == "The answer is four." and choice["finish_reason"] == "stop"


def test_a_prompt_that_opens_the_block_starts_in_reasoning(tokenizer):
    text = "Two and two.\n</think>\n\nFour."
    client, engine, tok = _client(tokenizer, QWEN3_OPEN, text)
    body = {"messages": MESSAGES, "max_tokens": len(tok.encode(text, add_special_tokens=False))}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert tok.decode(engine.calls[-1][1]).endswith("<|im_start|>assistant\n<think>\n")
    assert (message["reasoning_content"], message["content"]) == ("Two and two.", "Four.")


def test_max_tokens_inside_the_thinking_ends_with_reasoning_only(tokenizer):
    client, _, _ = _client(tokenizer, QWEN3, THOUGHT)
    whole = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5}).json()
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] is None and choice["message"]["reasoning_content"]
    deltas = [c["choices"][0]["delta"] for c in _stream(client, {"messages": MESSAGES, "max_tokens": 5})
              if c["choices"]]
    assert not any(d.get("content") for d in deltas)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == choice["message"]["reasoning_content"]


def test_without_a_parser_the_text_is_content_and_no_reasoning_key(tokenizer):
    client, _, tok = _client(tokenizer, QWEN3, THOUGHT, parser="none")
    tokens = len(tok.encode(THOUGHT, add_special_tokens=False))
    whole = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": tokens}).json()
    assert "reasoning_content" not in whole["choices"][0]["message"]
    assert "completion_tokens_details" not in whole["usage"]
    assert whole["choices"][0]["message"]["content"] == tok.decode(tok.encode(THOUGHT, add_special_tokens=False))


def test_tool_calls_are_parsed_from_the_answer_not_the_thinking(tokenizer):
    text = ('<think>\nMaybe <tool_call>{"name": "get_time", "arguments": {}}</tool_call>?\n</think>\n\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    client, _, tok = _client(tokenizer, QWEN3, text)
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n in ("get_weather", "get_time")]
    body = {"messages": MESSAGES, "tools": tools, "max_tokens": 200}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    assert "get_time" in choice["message"]["reasoning_content"]
    assert choice["finish_reason"] == "tool_calls"
    chunks = [c for c in _stream(client, body) if c["choices"]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == choice["message"]["reasoning_content"]
    streamed = [call["function"]["name"] for d in deltas for call in d.get("tool_calls") or []
                if call.get("function", {}).get("name")]
    assert streamed == ["get_weather"]


def _matcher(tokenizer, grammar: str):
    import llguidance.hf
    from pagedray.workers.sampling.grammar_limits import load_llguidance

    llguidance = load_llguidance()
    return llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer), grammar, log_level=0)


def _accepts(tokenizer, grammar: str, text: str) -> bool:
    matcher = _matcher(tokenizer, grammar)
    return all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) \
        and matcher.is_accepting()


def test_the_grammar_applies_after_the_reasoning(tokenizer):
    from pagedray.deploy.openai.structured_output import schema_grammar

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    answer = schema_grammar(schema, "response_format")
    closed = grammar_after_reasoning(answer, CLOSED)
    assert _accepts(tokenizer, closed, '<think>\nfree {text}\n</think>\n\n{"a":1}')
    assert _accepts(tokenizer, closed, '{"a":1}')
    assert not _accepts(tokenizer, closed, '<think>x</think>{"a":"no"}')
    assert not _accepts(tokenizer, closed, 'no thinking, no JSON')
    opened = grammar_after_reasoning(answer, OPEN)
    assert _accepts(tokenizer, opened, 'free text </think>\n{"a":2}')
    assert not _accepts(tokenizer, opened, '{"a":2}')          # the open block must close first


def test_a_structured_request_gets_the_wrapped_grammar(tokenizer):
    client, engine, tok = _client(tokenizer, QWEN3, THOUGHT)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {"messages": MESSAGES, "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    grammar = engine.calls[-1][2].grammar
    assert _accepts(tok, grammar, '<think>ok</think>{"a":3}') and not _accepts(tok, grammar, 'ok')
    client_off, engine_off, _ = _client(tokenizer, QWEN3, THOUGHT, parser="none")
    assert client_off.post("/v1/chat/completions", json=body).status_code == 200
    assert not _accepts(tok, engine_off.calls[-1][2].grammar, '<think>ok</think>{"a":3}')


def test_the_serve_option_is_checked_before_anything_starts():
    from pagedray.deploy.serve.app import parse_args

    assert parse_args({"reasoning_parser": "deepseek_r1"}).reasoning_parser == "deepseek_r1"
    assert parse_args({}).reasoning_parser == "auto"
    with pytest.raises(ValueError, match="reasoning_parser: must be one of auto, think, none"):
        parse_args({"reasoning_parser": "yes"})


# A "<think>" in text the user controls never moves the split: only the generation prompt decides (#61).
TAGGED = "In markup, what does <think> mean? Also: what is the capital of France?"
PLAIN = "In markup, what does this tag mean? Also: what is the capital of France?"
QWEN3_DOCS = "{%- for d in documents or [] %}{{ d['text'] }}\n{%- endfor %}" + QWEN3
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "",
                                                  "parameters": {"type": "object"}}}


def _chat_body(place: str, text: str) -> dict:
    """A chat body with ``text`` in the message (or field) ``place`` names."""
    messages = [{"role": "user", "content": text if place == "user" else "What is 2 + 2?"}]
    if place == "system":
        messages.insert(0, {"role": "system", "content": text})
    if place == "assistant":
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": text}] + messages
    body = {"messages": messages, "max_tokens": 60}
    if place == "tool":
        body["tools"] = [{**WEATHER_TOOL, "function": {**WEATHER_TOOL["function"], "description": text}}]
    if place == "document":
        body["documents"] = [{"title": "d", "text": text}]
    return body


def _split(message: dict) -> tuple:
    return message.get("reasoning_content"), message.get("content")


@pytest.mark.parametrize("place", ["user", "system", "assistant", "tool", "document"])
@pytest.mark.parametrize("structured", [False, True], ids=["free", "json"])
def test_a_think_tag_in_user_controlled_text_does_not_move_the_split(place, structured, tokenizer):
    client, engine, tok = _client(tokenizer, QWEN3_DOCS, THOUGHT)
    results = {}
    for name, text in (("tagged", TAGGED), ("plain", PLAIN)):
        body = _chat_body(place, text)
        if structured:
            body["response_format"] = {"type": "json_object"}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert ("<think>" in tok.decode(engine.calls[-1][1])) == (name == "tagged")   # the tag reached the prompt
        grammar = engine.calls[-1][2].grammar
        deltas = [c["choices"][0]["delta"] for c in _stream(client, body) if c["choices"]]
        streamed = ("".join(d.get("reasoning_content") or "" for d in deltas) or None,
                    "".join(d.get("content") or "" for d in deltas) or None)
        results[name] = (_split(response.json()["choices"][0]["message"]), streamed, grammar)
    assert results["tagged"] == results["plain"]
    assert results["plain"][0] == ("Two and two make four.", "The answer is four.")
    if structured:   # the JSON guarantee holds: the answer's grammar waits for a block that may open
        assert _accepts(tok, results["tagged"][2], '<think>ok</think>{"a":1}')
        assert not _accepts(tok, results["tagged"][2], 'free text {"a":1}')


def test_a_think_tag_in_the_input_does_not_move_the_split_on_responses_and_messages(tokenizer):
    client, _, _ = _client(tokenizer, QWEN3, THOUGHT)

    def responses(text):
        out = client.post("/v1/responses", json={"input": text, "instructions": text, "max_output_tokens": 60})
        assert out.status_code == 200, out.text
        items = out.json()["output"]
        return [(i["type"], [c.get("text") for c in i.get("content") or i.get("summary") or []]) for i in items]

    def messages(text):
        out = client.post("/v1/messages", json={"model": "m", "system": text, "max_tokens": 60,
                                                "messages": [{"role": "user", "content": text}]})
        assert out.status_code == 200, out.text
        return [(b["type"], b.get("thinking") or b.get("text")) for b in out.json()["content"]]

    assert responses(TAGGED) == responses(PLAIN)
    assert [kind for kind, _ in responses(TAGGED)] == ["reasoning", "message"]
    assert messages(TAGGED) == messages(PLAIN)
    assert messages(TAGGED) == [("thinking", "Two and two make four."), ("text", "The answer is four.")]


def test_the_generation_prompt_is_what_the_template_adds_after_the_last_message():
    from pagedray.deploy.openai.reasoning import generation_prompt_of

    assert generation_prompt_of("<u>hi</u><a><think>\n", "<u>hi</u>") == "<a><think>\n"
    assert generation_prompt_of("<u><think></u><a>", "<u><think></u>") == "<a>"
    assert generation_prompt_of("other rendering<a>", "<u>hi</u>") == ""
    assert not TAGS.prompt_opens(generation_prompt_of("<u><think></u><a>", "<u><think></u>"))
