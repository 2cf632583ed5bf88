"""Every top-level field of the four generation routes, given a value of a JSON type it does not take, is a
400 that names the field: never silently coerced or ignored (#61: ``parallel_tool_calls: "yes"`` was echoed
back as true, ``is_error: "yes"`` read as false). The allowed types come from the pydantic models for the
typed fields and from a table for the fields the routes read themselves; the app runs over a scripted TEST
DOUBLE engine and SmolLM2's tokenizer with a Qwen3 chat template."""

from __future__ import annotations

import copy
import pathlib
import types
import typing

import pytest
from fastapi.testclient import TestClient
from helpers.fake_engine import ScriptedEngine
from pagedray.deploy.http.routes import create_api
from pagedray.deploy.openai.metrics import ServerMetrics
from pagedray.deploy.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedray.deploy.openai.service import OpenAIService
from pagedray.deploy.openai.validation import ModelLimits
from pydantic import BaseModel

TEMPLATE = (pathlib.Path(__file__).parent.parent / "helpers" / "templates" / "qwen3.jinja").read_text()
WRONG = {"bool": True, "int": 7, "float": 1.5, "str": "yes", "list": ["yes"], "dict": {"yes": 1}}
NUMBER = ("int", "float")
BASES = {
    "/v1/completions": {"model": "m", "prompt": "hi", "max_tokens": 4},
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/responses": {"model": "m", "input": "hi", "max_output_tokens": 4},
    "/v1/messages": {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
}
# the fields a route reads itself (not typed by a pydantic model): the JSON types each takes
CHAT_EXTRAS = {"tool_choice": ("str", "dict"), "parallel_tool_calls": ("bool",), "response_format": ("dict",),
               "structured_outputs": ("dict",)}
RESPONSES = {"model": ("str",), "input": ("str", "list"), "instructions": ("str",), "tools": ("list",),
             "tool_choice": ("str", "dict"), "parallel_tool_calls": ("bool",), "text": ("dict",),
             "max_output_tokens": ("int",), "temperature": NUMBER, "top_p": NUMBER, "reasoning": ("dict",),
             "metadata": ("dict",), "user": ("str",), "stream": ("bool",)}
MESSAGES = {"model": ("str",), "max_tokens": ("int",), "messages": ("list",), "system": ("str", "list"),
            "tools": ("list",), "tool_choice": ("dict",), "stop_sequences": ("list",), "temperature": NUMBER,
            "top_p": NUMBER, "top_k": ("int",), "metadata": ("dict",), "stream": ("bool",), "thinking": ("dict",),
            "output_config": ("dict",)}


def json_types(annotation) -> set[str]:
    """The JSON types a (strict) pydantic annotation takes."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return json_types(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return set().union(*(json_types(a) for a in typing.get_args(annotation) if a is not type(None)))
    if origin is typing.Literal:
        return {"str"}
    if origin is list or annotation is list:
        return {"list"}
    if origin is dict or annotation is dict or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return {"dict"}
    return {bool: {"bool"}, int: {"int"}, float: {"int", "float"}, str: {"str"}}[annotation]


def model_fields(model: type[BaseModel]) -> dict[str, set[str]]:
    hints = typing.get_type_hints(model, include_extras=True)
    return {name: json_types(hints[name]) for name in model.model_fields}


CASES = [(route, field, kind) for route, fields in (
    ("/v1/completions", model_fields(CompletionRequest)),
    ("/v1/chat/completions", {**model_fields(ChatCompletionRequest), **{k: set(v) for k, v in CHAT_EXTRAS.items()}}),
    ("/v1/responses", {k: set(v) for k, v in RESPONSES.items()}),
    ("/v1/messages", {k: set(v) for k, v in MESSAGES.items()}),
) for field, allowed in fields.items() for kind in WRONG if kind not in allowed]


@pytest.fixture(scope="module")
def client(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TEMPLATE
    engine = ScriptedEngine(tok.encode("Hello there.", add_special_tokens=False) + [tok.eos_token_id],
                            eos_token_id=tok.eos_token_id)
    service = OpenAIService(engine, tok, ModelLimits("m", frozenset({"m"}), len(tok), 1024), ServerMetrics("m"))
    return TestClient(create_api(service))


def test_the_bases_are_served(client):
    for route, body in BASES.items():
        assert client.post(route, json=body).status_code == 200, route


def test_the_sweep_covers_the_fields_of_the_issue():
    assert ("/v1/responses", "parallel_tool_calls", "str") in CASES
    assert ("/v1/chat/completions", "parallel_tool_calls", "str") in CASES
    assert len(CASES) > 150


@pytest.mark.parametrize("route, field, kind", CASES)
def test_a_value_of_a_type_the_field_does_not_take_is_a_400_naming_it(client, route, field, kind):
    response = client.post(route, json={**BASES[route], field: WRONG[kind]})
    assert response.status_code == 400, f"{field}={WRONG[kind]!r}: {response.status_code} {response.text[:300]}"
    error = response.json()["error"]
    assert field in (error.get("param") or "") or field in error["message"], error


def test_an_anthropic_tool_result_is_error_must_be_a_boolean(client):
    turns = [{"role": "user", "content": "weather?"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "w", "input": {}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny",
                                           "is_error": "yes"}]}]
    response = client.post("/v1/messages", json={**BASES["/v1/messages"], "messages": turns})
    assert response.status_code == 400 and "is_error: must be a boolean" in response.json()["error"]["message"]
    turns[2]["content"][0]["is_error"] = True
    assert client.post("/v1/messages", json={**BASES["/v1/messages"], "messages": turns}).status_code == 200
