"""The ingress' structured-output checks (deploy/openai/structured_output.py): schemas without a finite instance,
the schema depth bound, and the GrammarChecker's compile + first masks under the shared limits, with the
real default tokenizer (no engine: the HTTP cases are in bad_requests.py)."""

from __future__ import annotations

import json

import pytest
from pagedray.deploy.openai.errors import APIError
from pagedray.deploy.openai.structured_output import (
    MAX_SCHEMA_DEPTH,
    GrammarChecker,
    has_finite_instance,
    nesting_depth,
    requested_grammar,
    schema_grammar,
)
from pagedray.workers.sampling.grammar_limits import MAX_ERROR_CHARS, load_llguidance

NODE = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array",
                                                                             "items": {"$ref": "#/$defs/node"}}},
        "required": ["v"]}
NO_FINITE_INSTANCE = {
    "ref_to_itself": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
    "root_ref": {"$ref": "#"},
    "any_of_only_itself": {"anyOf": [{"$ref": "#"}, {"$ref": "#/anyOf/0"}]},
    "required_property_is_the_object": {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
    "two_defs_require_each_other": {"$ref": "#/$defs/a", "$defs": {
        "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
        "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}}},
    "min_items_of_itself": {"type": "array", "minItems": 1, "items": {"$ref": "#"}},
    "prefix_item_is_itself": {"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1},
    "all_of_branch_is_itself": {"allOf": [{"type": "object"}, {"$ref": "#"}]},
    "additional_property_required": {"type": "object", "additionalProperties": {"$ref": "#"}, "required": ["k"]},
    "escaped_pointer": {"$ref": "#/$defs/a~1b", "$defs": {"a/b": {"$ref": "#/$defs/a~1b"}}},
}
FINITE = {
    "tree": {"$ref": "#/$defs/node", "$defs": {"node": NODE}},
    "optional_self": {"type": "object", "properties": {"x": {"$ref": "#"}}},
    "array_without_min_items": {"type": "array", "items": {"$ref": "#"}},
    "any_of_with_a_way_out": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
    "nullable_object": {"type": ["object", "null"], "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
    "no_type_means_any_value": {"properties": {"x": {"$ref": "#"}}, "required": ["x"]},
    "const_instance": {"const": {"x": 1}, "type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
    "missing_pointer_left_to_llguidance": {"$ref": "#/$defs/nowhere"},
    "id_scope_not_modelled": {"$id": "http://x/root", "$ref": "#/$defs/a",
                              "$defs": {"a": {"$id": "http://x/a", "$ref": "#"}}},
}


def nested(levels: int) -> dict:
    """A schema whose JSON nests ``levels`` objects deep (each level: the schema and its properties)."""
    schema: dict = {"type": "string"}
    for _ in range((levels - 1) // 2):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("name", sorted(NO_FINITE_INSTANCE))
def test_a_schema_without_a_finite_instance_is_a_400(name):
    schema = NO_FINITE_INSTANCE[name]
    assert not has_finite_instance(schema)
    for field, extra in [("structured_outputs", {"structured_outputs": {"json": schema}}),
                         ("structured_outputs", {"structured_outputs": {"json": json.dumps(schema)}}),
                         ("response_format", {"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "x", "schema": schema}}})]:
        with pytest.raises(APIError) as info:
            requested_grammar(extra)
        assert (info.value.status, info.value.param) == (400, field)
        assert "no finite instance" in info.value.message


@pytest.mark.parametrize("name", sorted(FINITE))
def test_a_schema_with_a_finite_instance_passes(name):
    assert has_finite_instance(FINITE[name])
    assert requested_grammar({"structured_outputs": {"json": FINITE[name]}})[0] == "structured_outputs"


def test_the_analysis_is_linear_in_refs():
    # each def may be either of two refs to the next: following both ways on every path is 2**60 paths
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"$ref": f"#/$defs/d{i + 1}"}]} for i in range(60)}
    assert not has_finite_instance({"$ref": "#/$defs/d0", "$defs": {**defs, "d60": {"$ref": "#/$defs/d0"}}})
    assert has_finite_instance({"$ref": "#/$defs/d0", "$defs": {**defs, "d60": {"type": "integer"}}})


def test_nesting_depth_counts_objects_and_arrays():
    assert [nesting_depth(v, 100) for v in (5, {}, [], {"a": [1]}, [[[]]], nested(9))] == [0, 1, 1, 2, 3, 9]
    assert nesting_depth("[" * 10, 100) == 0 and nesting_depth(nested(99), 10) == 11   # stops past the limit


def test_schema_depth_is_bounded_with_a_400_naming_the_field():
    assert schema_grammar(nested(MAX_SCHEMA_DEPTH - 1), "structured_outputs.json")
    for schema in (nested(MAX_SCHEMA_DEPTH + 2), "[" * 50_000 + "]" * 50_000, '{"a":' * 50_000 + "1" + "}" * 50_000,
                   json.dumps(nested(MAX_SCHEMA_DEPTH + 2))):
        with pytest.raises(APIError) as info:
            requested_grammar({"structured_outputs": {"json": schema}})
        assert (info.value.status, info.value.param) == (400, "structured_outputs")
        assert f"deeper than {MAX_SCHEMA_DEPTH} levels" in info.value.message


def test_boolean_schemas():
    assert schema_grammar(True, "response_format.json_schema.schema")
    with pytest.raises(APIError) as info:
        schema_grammar(False, "response_format.json_schema.schema")
    assert info.value.param == "response_format"


@pytest.fixture(scope="module")
def checker(default_model_path):
    from transformers import AutoTokenizer

    return GrammarChecker(AutoTokenizer.from_pretrained(default_model_path))


def _grammar(extra: dict) -> str:
    return requested_grammar(extra)[1]


@pytest.mark.parametrize("extra", [
    {"structured_outputs": {"json": {"$ref": "#/$defs/node", "$defs": {"node": NODE}}}},
    {"structured_outputs": {"json": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 100}, "email": {"type": "string", "format": "email"},
        "born": {"type": "string", "format": "date-time"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["name", "email", "born", "zip"]}}},
    {"structured_outputs": {"json": {"enum": [f"item-{i}" for i in range(1000)]}}},
    {"structured_outputs": {"regex": r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}"}},
    {"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    {"structured_outputs": {"regex": "a{100}"}},
    {"response_format": {"type": "json_object"}},
], ids=["tree", "person", "enum1000", "email", "choice", "a100", "json_object"])
def test_ordinary_grammars_pass_the_check(checker, extra):
    assert checker.error(_grammar(extra)) == ""


@pytest.mark.parametrize("regex", ["(a{1000}){1000}", "a{100000}"])
def test_a_lexer_that_explodes_is_refused_before_admission(checker, regex):
    # the red team's request: accepted by validate_grammar, then "lexer too complex" inside the engine
    message = checker.error(_grammar({"structured_outputs": {"regex": regex}}))
    assert message and "\n" not in message and "non-verbose" not in message
    with pytest.raises(APIError) as info:
        checker.check("structured_outputs", _grammar({"structured_outputs": {"regex": regex}}))
    assert (info.value.status, info.value.param) == (400, "structured_outputs")


def test_a_grammar_that_matches_nothing_is_refused_by_its_first_mask(checker):
    # past the schema analysis (built directly): llguidance's first mask finds no way on and no way to stop
    matcher = load_llguidance().LLMatcher
    recursive = matcher.grammar_from_json_schema({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}})
    assert checker.error(recursive) == "no text matches it"
    assert checker.error(matcher.grammar_from_regex(r"[^\s\S]")) == "no text matches it"


def test_errors_are_short_and_carry_no_parser_state(checker):
    message = checker.error(_grammar({"structured_outputs": {"regex": "(" + "x" * 5000}}))
    assert "unclosed group" in message and len(message) <= MAX_ERROR_CHARS and "\n" not in message
    bad_type = checker.error(_grammar({"structured_outputs": {"json": {"type": 5}}}))
    assert bad_type and "\n" not in bad_type
