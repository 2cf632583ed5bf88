"""Strict JSON schemas by default: an object schema that lists ``properties`` and leaves
``additionalProperties`` unset allows no other keys, for ``json_schema`` output, vLLM's
``structured_outputs.json`` and tool arguments; ``strict: false`` (or an explicit
``additionalProperties``) keeps JSON Schema's open default. Acceptance is checked with llguidance
matchers over the default model's tokenizer, on texts the old grammar let through."""

import json

import pytest
from pagedray.deploy.openai.errors import APIError
from pagedray.deploy.openai.structured_output import closed_objects, requested_grammar, schema_grammar
from pagedray.deploy.openai.tools import plan_tools, tool_grammar
from pagedray.workers.sampling.grammar_limits import load_llguidance

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WITH_EXTRA = '{"city":"Oslo","type":"string","description":"the city"}'
EXACT = '{"city":"Oslo"}'


@pytest.fixture(scope="module")
def accepts(tokenizer):
    llguidance = load_llguidance()
    lltok = llguidance.hf.from_tokenizer(tokenizer)

    def check(grammar: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()
    return check


def test_closed_objects_closes_every_listed_object_and_nothing_else():
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "b": {"type": "array", "items": {"type": "object", "properties": {"y": {"type": "string"}}}},
        "c": {"anyOf": [{"$ref": "#/$defs/d"}, {"type": "object"}]},
        "e": {"type": "object", "properties": {"z": {}}, "additionalProperties": {"type": "integer"}},
        "f": {"const": {"properties": {"kept": 1}}}},
        "$defs": {"d": {"properties": {"w": {"type": "boolean"}}}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert props["a"]["additionalProperties"] is False
    assert props["b"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in props["c"]["anyOf"][1]            # lists no properties: stays open
    assert props["e"]["additionalProperties"] == {"type": "integer"}      # set by the schema: kept
    assert props["f"] == {"const": {"properties": {"kept": 1}}}           # a literal, not a schema
    assert "additionalProperties" not in schema and "additionalProperties" not in schema["properties"]["a"]


def test_the_strict_grammar_refuses_keys_the_schema_does_not_list(accepts):
    strict, lax = schema_grammar(CITY, "response_format"), schema_grammar(CITY, "response_format", strict=False)
    assert accepts(lax, WITH_EXTRA) and accepts(lax, EXACT)       # what the old grammar let a model write
    assert not accepts(strict, WITH_EXTRA) and accepts(strict, EXACT)


def test_response_format_and_structured_outputs_are_strict_unless_told(accepts):
    def grammar(fields: dict) -> str:
        return requested_grammar(fields)[1]

    json_schema = {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}}
    assert not accepts(grammar({"response_format": json_schema}), WITH_EXTRA)
    opt_out = {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY, "strict": False}}
    assert accepts(grammar({"response_format": opt_out}), WITH_EXTRA)
    assert not accepts(grammar({"structured_outputs": {"json": CITY}}), WITH_EXTRA)
    open_schema = {**CITY, "additionalProperties": True}
    assert accepts(grammar({"structured_outputs": {"json": json.dumps(open_schema)}}), WITH_EXTRA)
    assert accepts(grammar({"response_format": {"type": "json_object"}}), WITH_EXTRA)   # any object still
    with pytest.raises(APIError, match="response_format.json_schema.strict: must be a boolean") as err:
        grammar({"response_format": {"type": "json_schema", "json_schema": {"schema": CITY, "strict": "yes"}}})
    assert err.value.param == "response_format"


def test_tool_arguments_are_strict_unless_the_function_says_otherwise(accepts):
    def call(arguments: str) -> str:
        return f'[{{"name":"get_weather","arguments":{arguments}}}]'

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
    strict = tool_grammar(plan_tools([tool], "required", None))
    assert not accepts(strict, call(WITH_EXTRA)) and accepts(strict, call(EXACT))
    lax_tool = {"type": "function", "function": {"name": "get_weather", "parameters": CITY, "strict": False}}
    assert accepts(tool_grammar(plan_tools([lax_tool], "required", None)), call(WITH_EXTRA))
    named = plan_tools([tool], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert not accepts(tool_grammar(named), WITH_EXTRA) and accepts(tool_grammar(named), EXACT)
    bad = {"type": "function", "function": {"name": "get_weather", "parameters": CITY, "strict": 1}}
    with pytest.raises(APIError, match=r"tools.0.function.strict: must be a boolean") as err:
        plan_tools([bad], "required", None)
    assert err.value.param == "tools"
