"""Streaming tool-call parsers (deploy/openai/tool_parsers.py): each format whole and streamed, markers split
across pieces, parallel calls, malformed output as content, template detection, and the contract's property:
any split of a text into pieces streams what parse_tool_calls returns for the whole text."""

from __future__ import annotations

import json
import re

import pytest
from helpers.tool_streams import checked_stream
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedray.deploy.openai.harmony import MARKERS as HARMONY_MARKERS
from pagedray.deploy.openai.tool_parsers import (
    TOOL_CALL_PARSERS,
    ToolCallStream,
    detect_tool_call_parser,
    keeps_special_tokens,
    merge_tool_deltas,
)
from pagedray.deploy.openai.tools import parse_tool_calls, plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
AUTO = plan_tools([WEATHER, TIME], "auto", None)
ONE = plan_tools([WEATHER, TIME], "auto", False)
REQUIRED = plan_tools([WEATHER, TIME], "required", None)
NAMED = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None)
ID = re.compile(r"call_[0-9a-f]{24}")


def summary(content, calls):
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def parsed(text, plan=AUTO, parser="hermes"):
    return summary(*parse_tool_calls(text, plan, parser))


def stream(pieces, plan=AUTO, parser="hermes"):
    """Every delta of the pieces, checked to be well-formed OpenAI deltas, and the stream."""
    return checked_stream(pieces, plan, parser)


def streamed(pieces, plan=AUTO, parser="hermes"):
    return summary(*merge_tool_deltas(stream(pieces, plan, parser)[0]))


def chars(text):
    return list(text)


# ---------------------------------------------------------------- each format, whole and character by character
FORMATS = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     ("Let me check.", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])),
    ("hermes", '{"name": "get_time", "parameters": {"tz": "UTC"}}', (None, [("get_time", '{"tz": "UTC"}')])),
    ("hermes", '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call> Done.',
     ("Done.", [("get_weather", '{"city": "Oslo"}')])),
    ("hermes", '<tool_call>{"name": "get_time"}</tool_call>', (None, [("get_time", "{}")])),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                    '{"name": "get_time", "parameters": {}}', (None, [("get_weather", '{"city": "Oslo"}'),
                                                                        ("get_time", "{}")])),
    ("llama3_json", ' {"type": "function", "name": "get_time", "parameters": {"tz": "CET"}}\n\nThat is all.',
     ("That is all.", [("get_time", '{"tz": "CET"}')])),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
                '{"name": "get_time", "arguments": {}, "id": "a1b2c3d4e"}]', ("Sure.", [
                    ("get_weather", '{"city": "Rome"}'), ("get_time", "{}")])),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{}',
     (None, [("get_weather", '{"city": "Rome"}'), ("get_time", "{}")])),
    ("mistral", '[{"name": "get_time", "arguments": {"tz": "UTC"}}]', (None, [("get_time", '{"tz": "UTC"}')])),
    ("pythonic", '[get_weather(city="Oslo, \'Norway\'", days=[1, -2.5], extra={"a": None, "b": true}), get_time()]',
     (None, [("get_weather", json.dumps({"city": "Oslo, 'Norway'", "days": [1, -2.5],
                                         "extra": {"a": None, "b": True}})), ("get_time", "{}")])),
    ("pythonic", "<|python_start|>[get_time(tz='UTC')] ok", ("ok", [("get_time", '{"tz": "UTC"}')])),
]


@pytest.mark.parametrize("parser, text, expected", FORMATS, ids=[f"{f[0]}-{i}" for i, f in enumerate(FORMATS)])
def test_each_format_whole_and_streamed_by_character(parser, text, expected):
    assert parsed(text, parser=parser) == expected
    assert streamed(chars(text), parser=parser) == expected
    assert streamed([text[:len(text) // 3], text[len(text) // 3:]], parser=parser) == expected


def test_required_and_named_outputs_stream_their_calls():
    text = ' [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {}}]'
    expected = (None, [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")])
    for parser in TOOL_CALL_PARSERS:   # the grammar's format, whatever the model's is
        assert parsed(text, REQUIRED, parser) == expected == streamed(chars(text), REQUIRED, parser)
    deltas, _ = stream(['{"ci', 'ty": "Os', 'lo"}\n'], NAMED)
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert [d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:]] == ['{"ci', 'ty": "Os', 'lo"}']
    assert parsed("Sorry, no.", NAMED) == ("Sorry, no.", []) and parsed("", NAMED) == (None, [])


def test_the_name_comes_first_then_the_arguments_as_the_model_writes_them():
    s = ToolCallStream(AUTO, "hermes")
    assert s.feed("Sure, one moment.") == [{"content": "Sure, one moment."}]
    assert s.feed(" <tool_") == []                     # a marker's start and the whitespace before it: held
    assert s.feed('call>{"name": "get_wea') == [] and not s.made_calls
    header, first = s.feed('ther", "arguments": {"ci')
    assert header["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""} and s.made_calls
    assert first == {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}
    assert s.feed('ty": "Oslo"  ') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"'}}]}]
    assert s.feed('}}</tool_call>\n') == [{"tool_calls": [{"index": 0, "function": {"arguments": "  }"}}]}]
    assert s.finish() == []                             # the whitespace after the call: dropped
    assert parsed("Sure, one moment. <tool_call>x") == ("Sure, one moment. <tool_call>x", [])


def test_whitespace_around_calls_is_stripped_and_kept_elsewhere():
    call = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert parsed(f"\n A {call} B \n")[0] == "\n A  B"      # leading whitespace before any call stays
    assert parsed(f"{call}\n\nB  {call}\n")[0] == "B"
    assert parsed("  \n") == ("  \n", []) and parsed("") == (None, [])
    s = ToolCallStream(AUTO)
    assert s.feed("Hello \n") == [{"content": "Hello"}] and s.feed("world") == [{"content": " \nworld"}]


def test_parallel_calls_and_parallel_false_keeps_the_first():
    text = "".join(f'<tool_call>{{"name": "get_time", "arguments": {{"n": {i}}}}}</tool_call>' for i in range(3))
    assert parsed(text) == (None, [("get_time", f'{{"n": {i}}}') for i in range(3)])
    assert parsed(text, ONE) == streamed(chars(text), ONE) == (None, [("get_time", '{"n": 0}')])
    pythonic = "[get_time(n=1), get_weather(city='x')]"
    assert parsed(pythonic, ONE, "pythonic") == (None, [("get_time", '{"n": 1}')])


@pytest.mark.parametrize("parser, text", [
    ("hermes", '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>'),
    ("hermes", "<tool_call>not json</tool_call> and <tool_call"),
    ("hermes", '<tool_call>{"arguments": {"a": 1}}</tool_call>'),
    ("hermes", '{"answer": 42, "name": "Bob"}'),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": '),
    ("llama3_json", 'The JSON is {"name": "get_time", "parameters": {}}'),
    ("llama3_json", '{"name": "get_' + "x" * 300),
    ("mistral", "[TOOL_CALLS]unknown[ARGS]{}"),
    ("mistral", "[TOOL_CALLS]get_time[ARGS][1]"),
    ("mistral", "[1] see the reference [TOOL_CALLS] [5]"),
    ("pythonic", "[get_time(1)]"),
    ("pythonic", "[get_time(tz=now())]"),
    ("pythonic", "[get_time(tz='UTC'"),
    ("pythonic", "[Note] it is fine [get_time()]"),
    ("pythonic", "[get_time(x=1e999)]"),
], ids=lambda v: v if v in TOOL_CALL_PARSERS else None)
def test_malformed_output_stays_content_whole_and_streamed(parser, text):
    assert parsed(text, parser=parser) == (text, []) == streamed(chars(text), parser=parser)


def test_a_failed_candidate_is_content_and_reading_resumes_after_it():
    text = 'A <tool_call>{"name": "nope"} B <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert parsed(text) == streamed(chars(text)) == ('A <tool_call>{"name": "nope"} B', [("get_time", "{}")])
    text = '[get_time(), 5]'
    assert parsed(text, parser="pythonic") == ("5]", [("get_time", "{}")])


def test_hermes_block_without_its_closing_tag_and_with_stray_braces():
    text = ('<tool_call>{"name": "get_time", "arguments": {"a": "}"}}}</tool_call> ok '
            '<tool_call>{"name": "get_time", "arguments": {"b": 2 <tool_call>{"name": "get_time", "arguments": {}}')
    assert parsed(text) == streamed(chars(text)) == ("ok", [("get_time", '{"a": "}"}'), ("get_time", '{"b": 2'),
                                                            ("get_time", "{}")])


def test_long_and_hostile_outputs_stay_linear():
    big = '<tool_call>{"name": "get_time", "arguments": {"s": "' + "x" * 200_000 + '"}}</tool_call>'
    pieces = [big[i:i + 7] for i in range(0, len(big), 7)]
    assert streamed(pieces)[1][0][1] == '{"s": "' + "x" * 200_000 + '"}'
    for text in ("<tool_call>x" * 20_000, "[TOOL_CALLS]" * 20_000, "{" * 100_000, "[get_time(" * 20_000,
                 " " * 100_000 + "x"):
        for parser in TOOL_CALL_PARSERS:
            assert parsed(text, parser=parser) == (text, [])


def test_unknown_parser_is_a_value_error():
    with pytest.raises(ValueError, match="unknown tool call parser"):
        ToolCallStream(AUTO, "qwen")


# ---------------------------------------------------------------- detection
@pytest.mark.parametrize("template, parser", [
    (None, "hermes"),
    ("{{ messages }}", "hermes"),
    ("{% for tool in tools %}<tools>{{ tool | tojson }}</tools>{% endfor %}<tool_call>\n", "hermes"),
    ("{%- if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", "mistral"),
    ("{{- '<|python_tag|>' + tool_call.name }} Respond in the format {\"name\": function name, \"parameters\": "
     "dictionary of argument name and its value}", "llama3_json"),
    ("Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}",
     "llama3_json"),
    ("you MUST put it in the format of [func_name1(params_name1=params_value1, params_name2=params_value2...), "
     "func_name2(params)] <|python_tag|>", "pythonic"),
])
def test_parser_detection_from_the_chat_template(template, parser):
    assert detect_tool_call_parser(template) == parser


def test_only_mistral_and_harmony_need_special_tokens_kept():
    assert {p for p in TOOL_CALL_PARSERS if keeps_special_tokens(p)} == {"mistral", "harmony"}


# ---------------------------------------------------------------- the property: any split streams the whole parse
CALLS = ['{"name": "get_weather", "arguments": {"city": "Oslo"}}', '{"name": "get_time", "parameters": {}}',
         '{"arguments": {"x": [1, "}"]}, "name": "get_time"}', '{"name": "get_time"}',
         '{"name": "nope", "arguments": {}}',
         '{"name": "get_time", "arguments": {"s": "a\\"b\\\\"}}', '{"name": "get_time", "arguments": 5}']
COMMON = [" ", "\n", "  ", "x", "Hi.", "{", "}", "[", "]", '"', ",", ";", "<", "\\", "NaN", ':', '"name"',
          '"arguments": {', '"get_time"']
FRAGMENTS = {   # whole calls of each format, their pieces, and near misses
    "hermes": CALLS + [f"<tool_call>{c}</tool_call>" for c in CALLS[:4]] + ["<tool_call>", "</tool_call>", "<tool_",
                                                                          "call>"],
    "llama3_json": CALLS + [f"<|python_tag|>{c}" for c in CALLS[:2]] + ["<|python_tag|>", "; ", "<|python_"],
    "mistral": CALLS + [f"[TOOL_CALLS][{c}]" for c in CALLS[:3]] + [
        "[TOOL_CALLS]", "[ARGS]", "get_time", "get_weather", "[TOOL_", "[{", "}]", ", ",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', "[TOOL_CALLS]get_time[ARGS]{}"],
    "pythonic": ["get_time()", "get_weather(city='Oslo')", "get_time(tz=\"a)b\", n=[1, (2)])", "nope()",
                 "get_time(1)", "(", ")", "=", "'", ", ", "<|python_start|>", "get_time(x=true)",
                 "[get_time()]", "[get_weather(city='Oslo'), get_time()]"],
    "qwen3_xml": ["<tool_call>", "</tool_call>", "<function=get_time>", "<function=get_weather>", "<function=nope>",
                  "</function>", "<parameter=city>", "<parameter=n>", "</parameter>", "\nOslo\n", "<tool_",
                  "<function=", "<parameter=", "</param", "\n<tool_call>\n<function=get_weather>\n<parameter=city>"
                  "\nOslo\n</parameter>\n</function>\n</tool_call>", CALLS[0]],
    "harmony": ["<|start|>", "assistant", "<|channel|>", "analysis", "final", "commentary", " to=functions.get_time",
                " to=functions.nope", "to=functions.get_weather", "<|constrain|>json", " json", "<|message|>",
                "<|end|>", "<|call|>", "<|return|>", "<|chan", "nel|>", '{"city": "Oslo"}', "{}",
                "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}<|call|>",
                "<|channel|>analysis<|message|>hm<|end|>", "<|start|>assistant<|channel|>final<|message|>ok"],
}
PLANS = st.sampled_from([AUTO, ONE, REQUIRED, NAMED])


@settings(max_examples=400, deadline=None)
@given(data=st.data(), parser=st.sampled_from(TOOL_CALL_PARSERS), plan=PLANS)
def test_any_split_streams_what_the_whole_text_parses_to(data, parser, plan):
    parts = st.sampled_from(FRAGMENTS[parser]) | st.sampled_from(COMMON) | st.text(max_size=3)
    text = "".join(data.draw(st.lists(parts, max_size=12), label="parts"))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8), label="cuts"))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    whole = parsed(text, plan, parser)
    assert streamed(pieces, plan, parser) == whole
    content, calls = whole
    assert content is None or content.strip() or not calls   # content around calls is stripped: never blank
    if parser == "harmony" and plan.choice == "auto":   # markers are special tokens: never content
        assert not any(marker in (content or "") + "".join(a for _, a in calls) for marker in HARMONY_MARKERS)
    elif not calls:
        assert content == (text or None)   # nothing is a call: all of it is content, nothing lost
