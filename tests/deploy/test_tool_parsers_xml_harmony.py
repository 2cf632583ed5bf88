"""The qwen3_xml and harmony tool-call formats (deploy/openai/tool_parsers_xml.py, harmony.py) and the harmony
reasoning split (reasoning.py): whole-text parses of realistic outputs, the contract's property (any split of
a text streams what the whole text parses to) with seeded random splits, auto-detection from the real chat
templates (tests/deploy/data, README there), the two harmony readers together, and both formats through the
HTTP app over the scripted TEST DOUBLE engine (helpers/fake_engine.py) with SmolLM2's tokenizer."""

from __future__ import annotations

import copy
import json
import pathlib
import random
import re

import pytest
from fastapi.testclient import TestClient
from helpers.fake_engine import ScriptedEngine
from helpers.tool_streams import checked_stream
from pagedray.deploy.http.routes import create_api
from pagedray.deploy.openai.harmony import MARKERS
from pagedray.deploy.openai.metrics import ServerMetrics
from pagedray.deploy.openai.reasoning import (
    HarmonyChannels,
    ReasoningStart,
    ReasoningTracker,
    ThinkTags,
    grammar_after_reasoning,
    resolve_reasoning_parser,
    split_text,
)
from pagedray.deploy.openai.service import OpenAIService
from pagedray.deploy.openai.sse import parse_sse
from pagedray.deploy.openai.tool_parsers import ToolCallStream, detect_tool_call_parser, merge_tool_deltas
from pagedray.deploy.openai.tools import parse_tool_calls, plan_tools, resolve_tool_call_parser
from pagedray.deploy.openai.validation import ModelLimits

DATA = pathlib.Path(__file__).parent / "data"
QWEN3_CODER = (DATA / "qwen3_coder.jinja").read_text()
GPT_OSS = (DATA / "gpt_oss.jinja").read_text()
QWEN3 = (pathlib.Path(__file__).parent.parent / "helpers" / "templates" / "qwen3.jinja").read_text()

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "celsius": {"type": "boolean"},
        "ratio": {"type": "number"}, "when": {"type": "object"}, "hours": {"type": "array"},
        "zip": {"type": "string"}, "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time"}}   # no schema: strings
AUTO = plan_tools([WEATHER, TIME], "auto", None)
ONE = plan_tools([WEATHER, TIME], "auto", False)
ID = re.compile(r"call_[0-9a-f]{24}")


def parsed(text, parser, plan=AUTO):
    content, calls = parse_tool_calls(text, plan, parser)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def streamed(pieces, parser, plan=AUTO):
    """The merged deltas of the pieces fed one by one, each delta checked to be a well-formed OpenAI delta."""
    content, calls = merge_tool_deltas(checked_stream(pieces, plan, parser)[0])
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def splits(text, rng, count):
    """``count`` random splits of ``text`` into pieces (one of them character by character)."""
    out = [list(text)]
    for _ in range(count - 1):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


def xml_call(name, *params, close=True):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>" if close else \
        f"<tool_call>\n<function={name}>\n{body}"


# ---------------------------------------------------------------- qwen3_xml, whole texts
def test_qwen3_xml_calls_with_content_before_them_and_typed_parameters():
    text = ("I'll look that up.\n\n" + xml_call("get_weather", ("city", "Oslo"), ("days", "3"), ("celsius", "True"),
                                                 ("ratio", "-0.5"), ("when", "{'from': 'now', 'n': (1, 2)}"),
                                                 ("hours", "[9, 12]"), ("zip", "0150"), ("limit", "null"))
            + "\n" + xml_call("get_time", ("tz", "UTC"), ("n", "3")))
    content, calls = parsed(text, "qwen3_xml")
    assert content == "I'll look that up."
    assert [name for name, _ in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0][1]) == {"city": "Oslo", "days": 3, "celsius": True, "ratio": -0.5,
                                       "when": {"from": "now", "n": [1, 2]}, "hours": [9, 12], "zip": "0150",
                                       "limit": None}
    assert json.loads(calls[1][1]) == {"tz": "UTC", "n": "3"}     # no schema: the text, as written


@pytest.mark.parametrize("key, value, expected", [
    ("days", "three", "three"),                 # does not parse: the string
    ("days", "3.5", "3.5"),                     # parses, but not to the declared integer
    ("ratio", "1e999", "1e999"),                # not finite: not JSON
    ("hours", "{1, 2}", "{1, 2}"),              # a Python set is no JSON array
    ("celsius", "yes", "yes"),
    ("city", "42", "42"),                       # a declared string keeps the text
    ("unknown_key", "42", "42"),                # no schema for the key
    ("city", "\n\nline one\nline two\n\n", "\n\nline one\nline two\n\n"),   # only the newlines around it go
    ("city", "  Oslo  ", "  Oslo  "),
    ("limit", "7", 7),
])
def test_qwen3_xml_value_types(key, value, expected):
    text = f"<tool_call>\n<function=get_weather>\n<parameter={key}>\n{value}\n</parameter>\n</function>\n</tool_call>"
    (_, arguments), = parsed(text, "qwen3_xml")[1]
    assert json.loads(arguments) == {key: expected}


def test_qwen3_xml_streams_the_header_then_one_piece_per_parameter():
    s = ToolCallStream(AUTO, "qwen3_xml")
    assert s.feed("Checking.\n<tool_call>\n<function=get_wea") == [{"content": "Checking."}]
    (header,) = s.feed("ther>\n<parameter=city>\nOs")
    assert header["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""} and s.made_calls
    assert s.feed("lo\n</parameter>\n") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Oslo"'}}]}]
    assert s.feed("<parameter=days>\n3\n</param") == []
    assert s.feed("eter>\n</function>\n</tool_call>") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": ', "days": 3}'}}]}]
    assert s.finish() == []


@pytest.mark.parametrize("text, expected", [
    # no parameters
    ("<tool_call>\n<function=get_time>\n</function>\n</tool_call>", (None, [("get_time", "{}")])),
    # the closing tags left out: a value ends at the next tag
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\n2\n</function>\n</tool_call>",
     (None, [("get_weather", '{"city": "Oslo", "days": 2}')])),
    # two functions in one block, text after the block
    ("<tool_call>\n<function=get_time>\n</function>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
     "</function>\n</tool_call>\nDone.", ("Done.", [("get_time", "{}"), ("get_weather", '{"city": "Rome"}')])),
    # no <tool_call> at the start of the output
    ("<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n</function>", (None, [("get_time", '{"tz": "CET"}')])),
    # a hermes block under the Qwen tags
    ('<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>',
     (None, [("get_time", '{"tz": "UTC"}')])),
    # cut short (max_tokens): closed with the parameters that ended; a value being written is dropped
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n1",
     (None, [("get_weather", '{"city": "Oslo"}')])),
    ("<tool_call>\n<function=get_weather>\n<parameter=ci", (None, [("get_weather", "{}")])),
    ("<tool_call>\n<function=get_weather>", (None, [("get_weather", "{}")])),
    # a key that never closes is dropped with what follows it up to the next tag
    ("<tool_call>\n<function=get_time>\n<parameter=" + "k" * 300 + "\n</function>\n</tool_call>",
     (None, [("get_time", "{}")])),
    # junk between parameters belongs to the call
    ("<tool_call>\n<function=get_time>\nhmm\n<parameter=tz>\nUTC\n</parameter>\nhm</function>\n</tool_call>",
     (None, [("get_time", '{"tz": "UTC"}')])),
])
def test_qwen3_xml_shapes(text, expected):
    assert parsed(text, "qwen3_xml") == expected
    assert streamed(list(text), "qwen3_xml") == expected


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=nope>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",   # unknown name
    "<tool_call>\n<function=get_wea",                                                            # name cut short
    "<tool_call>\n<func=get_time>\n</func>\n</tool_call>",
    "<tool_call>\n<function=get_time >\n</function>\n</tool_call>",
    "<b>bold</b> and <function=nope>",
    "<tool_call>\n<function=" + "x" * 100 + ">",
    "plain text with a < and a <tool_call",
])
def test_qwen3_xml_text_that_is_not_a_call_stays_content(text):
    assert parsed(text, "qwen3_xml") == (text, []) == streamed(list(text), "qwen3_xml")


def test_qwen3_xml_a_failed_call_is_content_and_the_next_block_is_read():
    text = ("A " + xml_call("nope", ("x", "1")) + " B " + xml_call("get_time"))
    content, calls = parsed(text, "qwen3_xml")
    assert content == "A " + xml_call("nope", ("x", "1")) + " B" and calls == [("get_time", "{}")]


def test_qwen3_xml_parallel_false_keeps_the_first_call():
    text = xml_call("get_time", ("n", "1")) + "\n" + xml_call("get_weather", ("city", "Oslo")) + "\nok"
    assert parsed(text, "qwen3_xml", ONE) == ("ok", [("get_time", '{"n": "1"}')]) == \
        streamed(list(text), "qwen3_xml", ONE)


# ---------------------------------------------------------------- harmony tool calls, whole texts
ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather. Call get_weather.<|end|>"
CALL_AFTER = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
              '{"city": "Oslo", "days": 3}<|call|>')
CALL_BEFORE = '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": "UTC"}<|call|>'
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Oslo.<|return|>"


@pytest.mark.parametrize("text, expected", [
    (ANALYSIS + FINAL, ("It is sunny in Oslo.", [])),            # alone, the tool parser drops the analysis
    (ANALYSIS + CALL_AFTER, (None, [("get_weather", '{"city": "Oslo", "days": 3}')])),
    (ANALYSIS + CALL_AFTER + CALL_BEFORE, (None, [("get_weather", '{"city": "Oslo", "days": 3}'),
                                                   ("get_time", '{"tz": "UTC"}')])),
    # the recipient right after the generation prompt's role, <|call|> left out by the detokenizer (EOS)
    (' to=functions.get_time<|channel|>commentary json<|message|>{"tz": "CET"}',
     (None, [("get_time", '{"tz": "CET"}')])),
    ("<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}", (None, [("get_time", "{}")])),
    # a preamble on the commentary channel, then the call
    ("<|channel|>commentary<|message|>Let me check.<|end|>" + CALL_BEFORE, ("Let me check.",
                                                                           [("get_time", '{"tz": "UTC"}')])),
    # an unknown function, a body that is no object: content, never the markers or the header
    ("<|channel|>commentary to=functions.nope json<|message|>{\"a\": 1}<|call|>", ('{"a": 1}', [])),
    ("<|channel|>commentary to=functions.get_time<|message|>now please<|call|>", ("now please", [])),
    ("<|channel|>commentary to=python<|message|>print(1)<|call|>", ("print(1)", [])),
    # cut short: the arguments as written; a marker inside a string still ends them
    (ANALYSIS + '<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>{"city": "Os',
     (None, [("get_weather", '{"city": "Os')])),
    ('<|channel|>commentary to=functions.get_weather<|message|>{"city": "Os<|end|><|start|>assistant<|channel|>final'
     "<|message|>ok", ("ok", [("get_weather", '{"city": "Os')])),
    # text after the object, stray markers, a header cut short: dropped
    ('<|channel|>commentary to=functions.get_time<|message|>{} trailing<|call|>', (None, [("get_time", "{}")])),
    ("<|channel|>final<|message|>A<|constrain|>B<|message|>C<|end|><|start|>assistant<|chan", ("ABC", [])),
    ("<|channel|>final<|message|>A<|start|>assistant<|start|>assistant<|channel|>final<|message|>B", ("AB", [])),
    # output that starts without a header (a grammar forced it) is content
    ("  plain answer", ("  plain answer", [])),
    ("to", ("to", [])),
    ("", (None, [])),
])
def test_harmony_messages(text, expected):
    assert parsed(text, "harmony") == expected
    assert streamed(list(text), "harmony") == expected


def test_harmony_streams_the_arguments_as_they_come_and_never_a_marker():
    s = ToolCallStream(AUTO, "harmony")
    assert s.feed("<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>commentary to=functions.") == []
    assert s.feed("get_weather <|constrain|>json<|mess") == []
    header, first = s.feed('age|>{"city"')
    assert header["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city"'}}]}
    assert s.feed(': "Oslo"}<|ca') == [{"tool_calls": [{"index": 0, "function": {"arguments": ': "Oslo"}'}}]}]
    assert s.feed("ll|>") == [] and s.finish() == []


def test_harmony_parallel_false_keeps_the_first_call():
    text = ANALYSIS + CALL_AFTER + CALL_BEFORE
    assert parsed(text, "harmony", ONE) == (None, [("get_weather", '{"city": "Oslo", "days": 3}')])


# ---------------------------------------------------------------- the property: any split streams the whole parse
XML_PARTS = ["<tool_call>", "</tool_call>", "\n", " ", "x", "Hi.", "<", ">", "{", "}", '"', "<function=get_time>",
             "<function=get_weather>", "<function=nope>", "</function>", "<parameter=city>", "<parameter=days>",
             "<parameter=", "</parameter>", "\nOslo\n", "3", "True", "[1, 2]", "<tool_", "<function=", "</param",
             "</func", xml_call("get_weather", ("city", "Oslo"), ("days", "2")), xml_call("get_time"),
             '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>']
HARMONY_PARTS = ["<|start|>", "assistant", "<|channel|>", "analysis", "final", "commentary", " to=functions.get_time",
                 " to=functions.nope", "to=functions.get_weather", " to=python", "<|constrain|>", "json", " ",
                 "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|", "|>", "<|chan", "nel|>", "{", "}", '"',
                 '{"city": "Oslo"}', '{"tz": "<|end|>"}', "{}", "x", "\n", "hi.", ANALYSIS, CALL_AFTER, CALL_BEFORE,
                 FINAL]
# text that is part of a marker: next to another such piece it may spell one, as ordinary text
PARTIAL = {"<|", "|>", "<|chan", "nel|>"}


def draw(rng, parts):
    """A text of up to 14 random parts, and whether none of them is a piece of a marker."""
    drawn = [rng.choice(parts) for _ in range(rng.randint(0, 14))]
    return "".join(drawn), not PARTIAL.intersection(drawn)


@pytest.mark.parametrize("parser, parts", [("qwen3_xml", XML_PARTS), ("harmony", HARMONY_PARTS)])
@pytest.mark.parametrize("plan", [AUTO, ONE], ids=["parallel", "one"])
def test_any_split_streams_what_the_whole_text_parses_to(parser, parts, plan):
    rng = random.Random(f"{parser}-{plan.parallel}")
    for _ in range(300):
        text, clean = draw(rng, parts)
        whole = parsed(text, parser, plan)
        for pieces in splits(text, rng, 4):
            assert streamed(pieces, parser, plan) == whole, (text, pieces)
        content, calls = whole
        if parser == "harmony":     # markers are special tokens: never content, never arguments
            assert not clean or not any(m in (content or "") + "".join(a for _, a in calls) for m in MARKERS), text
        elif not calls:
            assert content == (text or None)
        if parser == "qwen3_xml" and "{" not in text:   # built here: always a JSON object
            assert all(isinstance(json.loads(arguments), dict) for _, arguments in calls), text


def test_long_outputs_stay_linear():
    value = "line\n" * 40_000
    text = xml_call("get_time", ("code", value))
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    assert json.loads(streamed(pieces, "qwen3_xml")[1][0][1]) == {"code": value}
    body = "<|channel|>final<|message|>" + "word " * 40_000
    assert streamed([body[i:i + 3] for i in range(0, len(body), 3)], "harmony") == ("word " * 40_000, [])
    for text in (" " * 200_000 + "x", "<|" * 50_000, "<parameter=" * 20_000, "<tool_call><function=get_time>"
                 + "<parameter=" * 20_000):
        for parser in ("qwen3_xml", "harmony"):
            assert streamed([text[i:i + 2] for i in range(0, len(text), 2)], parser) == parsed(text, parser)


# ---------------------------------------------------------------- the harmony reasoning split
HARMONY = HarmonyChannels()
CLOSED, OPEN = ReasoningStart(HARMONY, False), ReasoningStart(HARMONY, True)
RAW = ReasoningStart(HARMONY, False, raw_messages=True)


@pytest.mark.parametrize("start, text, reasoning, content", [
    (CLOSED, ANALYSIS + FINAL, "The user wants the weather. Call get_weather.", "It is sunny in Oslo."),
    (CLOSED, "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
             "<|start|>assistant<|channel|>final<|message|>c", "a\nb", "c"),
    (CLOSED, "<|channel|>analysis<|message|>still thinking", "still thinking", None),     # cut by max_tokens
    (CLOSED, "<|channel|>final<|message|>Four.<|return|>", None, "Four."),
    (CLOSED, "Four.", None, "Four."),                                                     # no channel at all
    (CLOSED, ANALYSIS + CALL_AFTER, "The user wants the weather. Call get_weather.", '{"city": "Oslo", "days": 3}'),
    (OPEN, "thinking<|end|><|start|>assistant<|channel|>final<|message|> ok ", "thinking", " ok "),
    (CLOSED, " to=functions.get_time<|channel|>analysis<|message|>{}<|call|>", None, "{}"),   # a call is no thinking
    (CLOSED, "<|channel|>analysis<|message|><|end|><|channel|>final<|message|>x<|chan", None, "x<|chan"),
    # raw: the messages that are not reasoning reach the content as written (for the harmony tool parser)
    (RAW, ANALYSIS + CALL_AFTER, "The user wants the weather. Call get_weather.", CALL_AFTER),
    (RAW, " to=functions.get_time<|channel|>commentary<|message|>{}", None,
     " to=functions.get_time<|channel|>commentary<|message|>{}"),
])
def test_harmony_split_cases(start, text, reasoning, content):
    got = split_text(text, start)
    assert (got.reasoning, got.content) == (reasoning, content)


def _feed_all(tracker, pieces):
    out = []
    for i, piece in enumerate(pieces):
        out.append(tracker.feed(piece, 1, last=i == len(pieces) - 1))
    return "".join(r for r, _ in out), "".join(c for _, c in out)


@pytest.mark.parametrize("start", [CLOSED, OPEN, RAW], ids=["closed", "open", "raw"])
def test_any_split_streams_the_whole_harmony_split(start):
    rng = random.Random(f"split-{start.opened}-{start.raw_messages}")
    for _ in range(300):
        text, clean = draw(rng, HARMONY_PARTS)
        whole = split_text(text, start)
        for pieces in splits(text, rng, 4):
            tracker = ReasoningTracker(start)
            reasoning, content = _feed_all(tracker, pieces or [""])
            assert tracker.message() == whole, (text, pieces)
            assert (reasoning, content) == (whole.reasoning or "", whole.content or ""), (text, pieces)
        if clean and not start.raw_messages:
            assert not any(m in (whole.reasoning or "") + (whole.content or "") for m in MARKERS), text


def _reason_then_parse(pieces, plan=AUTO):
    """The service's pipeline: the harmony splitter (raw messages), its content into the harmony tool stream."""
    tracker, stream, reasoning, deltas = ReasoningTracker(RAW, keep=False), ToolCallStream(plan, "harmony"), [], []
    for i, piece in enumerate(pieces or [""]):
        last = i == len(pieces or [""]) - 1
        r, c = tracker.feed(piece, 1, last)
        reasoning.append(r)
        deltas += stream.feed(c) + (stream.finish() if last else [])
    content, calls = merge_tool_deltas(deltas)
    return "".join(reasoning), content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_harmony_reasoning_and_tool_calls_together():
    text = ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + CALL_AFTER
    expected = ("The user wants the weather. Call get_weather.", "Checking.",
                [("get_weather", '{"city": "Oslo", "days": 3}')])
    assert _reason_then_parse([text]) == expected == _reason_then_parse(list(text))
    assert _reason_then_parse([ANALYSIS + FINAL]) == ("The user wants the weather. Call get_weather.",
                                                     "It is sunny in Oslo.", [])
    rng = random.Random("together")
    for _ in range(200):
        text, clean = draw(rng, HARMONY_PARTS)
        whole = _reason_then_parse([text])
        assert whole[0] == (split_text(text, CLOSED).reasoning or "")   # the same reasoning as without tools
        if clean:
            assert not any(m in whole[0] + (whole[1] or "") + "".join(a for _, a in whole[2]) for m in MARKERS)
        for pieces in splits(text, rng, 3):
            assert _reason_then_parse(pieces) == whole, (text, pieces)


def test_harmony_prompt_opens():
    assert not HARMONY.prompt_opens("<|start|>user<|message|>hi<|end|><|start|>assistant")
    assert HARMONY.prompt_opens("<|start|>assistant<|channel|>analysis<|message|>")
    assert not HARMONY.prompt_opens("<|start|>assistant<|channel|>final<|message|>")
    assert not HARMONY.prompt_opens("<|start|>assistant<|channel|>analysis<|message|>x<|end|>")
    assert HARMONY.keeps_special_tokens and not ThinkTags().keeps_special_tokens


SCHEMA_GRAMMAR = json.dumps({"grammars": [{"json_schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                           "required": ["a"], "additionalProperties": False}}]})
FINAL_JSON = '<|start|>assistant<|channel|>final<|message|>{"a": 4}'
FINAL_COMPACT = '<|start|>assistant<|channel|>final<|message|>{"a":4}'     # the server's JSON grammars are compact


def _harmony_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    return tok


def _follows(tok, grammar: str, text: str) -> bool:
    """Whether llguidance, token by token over ``text`` (markers as special tokens), accepts it as a whole output."""
    import llguidance.hf

    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok), grammar, log_level=0)
    return all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) \
        and not matcher.is_error() and matcher.is_accepting()


@pytest.mark.parametrize("text, follows", [
    (ANALYSIS + FINAL_JSON, True),                                   # reasoning, then the answer in the final channel
    (ANALYSIS + "<|start|>assistant" + ANALYSIS + FINAL_JSON, True),  # two analysis messages
    (FINAL_JSON[len("<|start|>assistant"):], True),                  # straight to the answer
    ('{"a": 4}', False),                                             # an answer without its channel
    (ANALYSIS + '<|start|>assistant<|channel|>final<|message|>It is 4.', False),     # not the schema
    (ANALYSIS + '<|start|>assistant<|channel|>commentary<|message|>{"a": 4}', False),
    ('<|channel|>analysis<|message|>x' + FINAL_JSON, False),         # a message without its end
])
def test_harmony_grammar_constrains_the_final_body_after_free_analysis(tokenizer, text, follows):
    tok = _harmony_tokenizer(tokenizer)
    assert _follows(tok, grammar_after_reasoning(SCHEMA_GRAMMAR, CLOSED), text) is follows


def test_harmony_grammar_from_a_prompt_that_opens_the_analysis(tokenizer):
    tok = _harmony_tokenizer(tokenizer)
    grammar = grammar_after_reasoning(SCHEMA_GRAMMAR, OPEN)
    assert _follows(tok, grammar, "thinking more.<|end|>" + FINAL_JSON)
    assert not _follows(tok, grammar, FINAL_JSON[len("<|start|>assistant"):])   # the open body must end first


# ---------------------------------------------------------------- detection from the real templates
def test_auto_detection_from_the_real_chat_templates(tokenizer):
    assert detect_tool_call_parser(QWEN3_CODER) == "qwen3_xml"     # it also has <tool_call>: not hermes
    assert detect_tool_call_parser(GPT_OSS) == "harmony"
    assert detect_tool_call_parser(QWEN3) == "hermes"
    assert detect_tool_call_parser("<function=f> only") == "hermes" != detect_tool_call_parser("<function=<parameter=")
    assert resolve_reasoning_parser("auto", GPT_OSS) == HARMONY
    assert resolve_reasoning_parser("auto", QWEN3_CODER) is None
    assert resolve_reasoning_parser("harmony", None) == HARMONY
    assert resolve_reasoning_parser("auto", QWEN3) == ThinkTags()
    tok = copy.deepcopy(tokenizer)
    for template, parser in ((QWEN3_CODER, "qwen3_xml"), (GPT_OSS, "harmony")):
        tok.chat_template = template
        assert resolve_tool_call_parser("auto", tok) == parser == resolve_tool_call_parser(parser, tok)


def test_the_templates_earlier_calls_parse_back_to_themselves(tokenizer):
    """An assistant turn with a call, as each real template renders it, is the form the model writes."""
    tools = [WEATHER, TIME]
    arguments = {"city": "Oslo", "days": 3, "celsius": False, "hours": [9, 12]}
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
                {"role": "tool", "content": "sunny"}]
    qwen = tokenizer.apply_chat_template(messages, tools=tools, chat_template=QWEN3_CODER, tokenize=False)
    turn = qwen.split("<|im_start|>assistant")[1].split("<|im_end|>")[0]
    (name, args), = parsed(turn, "qwen3_xml")[1]
    assert name == "get_weather" and json.loads(args) == arguments
    oss = tokenizer.apply_chat_template(messages, tools=tools, chat_template=GPT_OSS, tokenize=False)
    turn = oss[oss.index("<|start|>assistant to="):].split("<|start|>functions.")[0]
    (name, args), = parsed(turn, "harmony")[1]
    assert name == "get_weather" and json.loads(args) == arguments
    assert parsed(turn[len("<|start|>assistant"):], "harmony") == parsed(turn, "harmony")   # right after the prompt


# ---------------------------------------------------------------- through the HTTP app
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]
HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"]


def _client(tok, text: str, engine: ScriptedEngine | None = None):
    engine = engine or ScriptedEngine(tok.encode(text, add_special_tokens=False) + [tok.eos_token_id],
                                      eos_token_id=tok.eos_token_id)
    limits = ModelLimits("m", frozenset({"m"}), len(tok), 4096)
    return TestClient(create_api(OpenAIService(engine, tok, limits, ServerMetrics("m"))))


def _whole_and_streamed(client, body):
    whole = client.post("/v1/chat/completions", json=body)
    assert whole.status_code == 200, whole.text
    events = [e for e in parse_sse(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
              if e != "[DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events[1:]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas) or None
    content, calls = merge_tool_deltas([{k: v for k, v in d.items() if k != "reasoning_content"} for d in deltas])
    return whole.json()["choices"][0], (reasoning, content, calls, events[-1]["choices"][0]["finish_reason"])


def test_gpt_oss_through_the_app_with_and_without_tools(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tok.chat_template = GPT_OSS
    client = _client(tok, ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + CALL_AFTER)
    body = {"messages": MESSAGES, "tools": [WEATHER], "max_tokens": 300}
    choice, (reasoning, content, calls, finish) = _whole_and_streamed(client, body)
    message = choice["message"]
    assert message["reasoning_content"] == reasoning == "The user wants the weather. Call get_weather."
    assert message["content"] == content == "Checking."
    assert [c["function"] for c in message["tool_calls"]] == [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 3}'}]
    assert choice["finish_reason"] == finish == "tool_calls"
    # without tools the markers are still kept for the reasoning split, and none reaches the answer
    choice, (reasoning, content, calls, finish) = _whole_and_streamed(_client(tok, ANALYSIS + FINAL),
                                                                      {"messages": MESSAGES, "max_tokens": 300})
    assert (choice["message"]["reasoning_content"], choice["message"]["content"]) == (reasoning, content) == (
        "The user wants the weather. Call get_weather.", "It is sunny in Oslo.")
    assert calls == [] and choice["finish_reason"] == finish == "stop"


def test_gpt_oss_response_format_through_the_app(tokenizer):
    """A json_schema request to a harmony model: the grammar the engine gets accepts the analysis then the final
    message (the script), the reasoning stays reasoning and the answer is the content."""
    tok = _harmony_tokenizer(tokenizer)
    tok.chat_template = GPT_OSS
    engine = ScriptedEngine(tok.encode(ANALYSIS + FINAL_COMPACT, add_special_tokens=False) + [tok.eos_token_id],
                            eos_token_id=tok.eos_token_id)
    client = _client(tok, "", engine)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {"messages": MESSAGES, "max_tokens": 300,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
    choice, (reasoning, content, _, finish) = _whole_and_streamed(client, body)
    assert (choice["message"]["reasoning_content"], choice["message"]["content"]) == (reasoning, content) == (
        "The user wants the weather. Call get_weather.", '{"a":4}')
    assert choice["finish_reason"] == finish == "stop"
    grammar = engine.calls[-1][2].grammar
    assert _follows(tok, grammar, ANALYSIS + FINAL_COMPACT) and not _follows(tok, grammar, '{"a":4}')


def test_gpt_oss_required_tool_choice_through_the_app(tokenizer):
    """A required tool choice on a harmony model: the calls' JSON is the final message's body (the grammar holds
    it there after free analysis), read as calls; the analysis stays reasoning."""
    tok = _harmony_tokenizer(tokenizer)
    tok.chat_template = GPT_OSS
    final = '<|start|>assistant<|channel|>final<|message|>[{"name":"get_weather","arguments":{"city":"Oslo"}}]'
    engine = ScriptedEngine(tok.encode(ANALYSIS + final, add_special_tokens=False) + [tok.eos_token_id],
                            eos_token_id=tok.eos_token_id)
    client = _client(tok, "", engine)
    body = {"messages": MESSAGES, "max_tokens": 300, "tools": [WEATHER], "tool_choice": "required"}
    choice, (reasoning, content, calls, finish) = _whole_and_streamed(client, body)
    message = choice["message"]
    assert message["reasoning_content"] == reasoning == "The user wants the weather. Call get_weather."
    assert [c["function"] for c in message["tool_calls"]] == [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city":"Oslo"}'}]
    assert not message["content"] and not content and choice["finish_reason"] == finish == "tool_calls"
    assert _follows(tok, engine.calls[-1][2].grammar, ANALYSIS + final)


def test_qwen3_coder_through_the_app(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = QWEN3_CODER
    text = "Let me check.\n" + xml_call("get_weather", ("city", "Oslo"), ("days", "3"))
    choice, (reasoning, content, calls, finish) = _whole_and_streamed(
        _client(tok, text), {"messages": MESSAGES, "tools": [WEATHER], "max_tokens": 300})
    assert "reasoning_content" not in choice["message"] and reasoning is None
    assert choice["message"]["content"] == content == "Let me check."
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 3}'}]
    assert choice["finish_reason"] == finish == "tool_calls"


def test_a_harmony_grammar_on_a_tokenizer_without_its_markers_is_a_400_and_nothing_reaches_the_engine(tokenizer):
    """reasoning_parser forced to harmony on a tokenizer without the marker tokens: the wrapped grammar names
    special tokens the tokenizer lacks, so response_format is refused (400 naming it); other requests go on."""
    engine = ScriptedEngine(tokenizer.encode("hi", add_special_tokens=False) + [tokenizer.eos_token_id],
                            eos_token_id=tokenizer.eos_token_id)
    limits = ModelLimits("m", frozenset({"m"}), len(tokenizer), 4096)
    client = TestClient(create_api(OpenAIService(engine, tokenizer, limits, ServerMetrics("m"),
                                                 reasoning_parser="harmony")))
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}}
    refused = client.post("/v1/chat/completions", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format"
    assert "<|channel|>" in refused.json()["error"]["message"] and engine.calls == []
    assert client.post("/v1/chat/completions", json={**body, "response_format": None}).status_code == 200
    assert client.get("/health").status_code == 200
