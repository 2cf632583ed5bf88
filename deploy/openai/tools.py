"""Tool calling on chat: the request's tools -> the prompt (and a grammar); the output -> ``tool_calls``.

- ``tools``: OpenAI function tools (``{"type": "function", "function": {"name", "description",
  "parameters"}}``): a name of letters, digits, ``_ . -`` (at most 64), a string description, parameters
  a JSON schema of an object nested at most ``MAX_SCHEMA_DEPTH`` levels; the plan keeps these three keys.
  A chat template that knows tools (its source mentions ``tools``) renders them itself; otherwise a
  system message written here lists them as JSON and asks for calls in the Hermes form
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
- ``tool_choice``: ``"none"`` (tools ignored: no prompt, no parsing), ``"auto"`` (the default: the model
  decides; the text is parsed after generation), ``"required"`` and ``{"type": "function", "function":
  {"name"}}`` (enforced by an llguidance grammar: a JSON array of ``{"name", "arguments"}`` objects
  whose arguments follow each tool's ``parameters`` (their local ``$ref``s rebased to where they sit in
  that array schema), or, for a named function, its arguments object alone, as vLLM does).
  ``parallel_tool_calls: false`` allows one call.
- Every malformed ``tools``, ``tool_choice``, ``parallel_tool_calls`` (also with ``tool_choice: "none"``)
  and every malformed ``tool_calls`` entry of an earlier assistant turn (``{"id", "type": "function",
  "function": {"name": str, "arguments": str}}``) is a 400 naming the field, never a 500.
- Parsing (tool_parsers.py has the contract): each choice's text goes through a ``ToolCallStream`` of the
  model's format (``hermes`` by default: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, or an output that is Llama-3's ``{"name": ..., "parameters": {...}}``; also ``llama3_json``,
  ``mistral``, ``pythonic``, ``qwen3_xml`` and ``harmony``; ``required`` / named output is the grammar's
  JSON). A call needs a known ``name`` and arguments that are a JSON object (``parameters`` accepted for
  ``arguments``); its ``arguments`` are the raw JSON text the model wrote (qwen3_xml: the object built from
  its parameters, typed by the tool's schema), kept as written when they turn out malformed or cut short
  (``max_tokens``). Text that is not such a call (invalid JSON, a name that is not a known string,
  arguments that are not an object) stays in the content, stripped where it meets calls (``null`` when
  empty); parsing model output never raises and is linear in the text. ``parallel_tool_calls: false``
  keeps the first call and drops later ones.
- Calls get ids ``call_<24 hex>``; the finish reason becomes ``"tool_calls"`` when a choice that stopped
  made calls.
- Streams of a tools request are incremental (service.py): each choice's text goes through its
  ``ToolCallStream`` as it arrives, so content streams as it comes and a call as OpenAI streams it (a delta
  with ``index``, ``id``, ``type`` and the name, then pieces of ``arguments``). Such streams carry no
  ``logprobs``. The format is the ``tool_call_parser`` option (``resolve_tool_call_parser``); a format
  whose marker is a special token (``keeps_special_tokens``) makes the detokenizer keep special tokens for
  that request.
"""

from __future__ import annotations

import json
import re

from .errors import bad_request
from .structured_output import (
    MAX_GRAMMAR_CHARS,
    MAX_SCHEMA_DEPTH,
    NAMED_SCHEMAS,
    check_schema_depth,
    closed_objects,
    schema_grammar,
    strict_flag,
)
from .tool_parsers import TOOL_CALL_PARSERS, ToolCallStream, detect_tool_call_parser, merge_tool_deltas
from .tool_plan import ToolPlan

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
# levels tool_schema puts around a tool's parameters: root, items, anyOf, the call, its properties
TOOL_SCHEMA_WRAP_DEPTH = 5
_CHOICES = ("none", "auto", "required")
_LITERALS = ("const", "enum", "default", "examples")


def _function(tool, i: int) -> dict:
    """The function object of ``tools[i]``, reduced to name / description / parameters; 400 naming tools."""
    where = f"tools.{i}"
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or tool.get("type") != "function":
        raise bad_request(f"{where}: must be {{'type': 'function', 'function': {{'name': ...}}}}", param="tools")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(f"{where}.function.name: must be a string of letters, digits, '_', '.', '-' (at most 64)",
                          param="tools")
    if not isinstance(function.get("description", ""), (str, type(None))):
        raise bad_request(f"{where}.function.description: must be a string", param="tools")
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise bad_request(f"{where}.function.parameters: must be a JSON schema of an object (type 'object')",
                              param="tools")
        check_schema_depth(parameters, f"{where}.function.parameters", "tools")
        if strict_flag(function.get("strict"), f"tools.{i}.function.strict"):
            parameters = closed_objects(parameters)   # strict by default: no keys the schema does not list
    out = {key: function[key] for key in ("name", "description") if function.get(key) is not None}
    return out if parameters is None else {**out, "parameters": parameters}


def _choice(tool_choice) -> tuple[str, str | None]:
    """(choice, function name) of ``tool_choice``; 400 naming tool_choice for any other shape."""
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str) and tool_choice in _CHOICES:
        return tool_choice, None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(function, dict) or tool_choice.get("type") != "function" \
            or not isinstance(function.get("name"), str):
        raise bad_request("tool_choice: must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                          "{'name': <a function of tools>}}", param="tool_choice")
    return "named", function["name"]


def plan_tools(tools: list | None, tool_choice, parallel_tool_calls) -> ToolPlan | None:
    """Validated tool request, or None when there is nothing to do (no tools, or ``tool_choice`` "none")."""
    choice, name = _choice(tool_choice)
    if tools is not None and not isinstance(tools, list):
        raise bad_request("tools: must be a list of function tools", param="tools")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):   # with or without tools
        raise bad_request("parallel_tool_calls: must be a boolean", param="parallel_tool_calls")
    if not tools:
        if choice in ("required", "named"):
            raise bad_request("tool_choice: needs tools", param="tool_choice")
        return None
    functions = [_function(tool, i) for i, tool in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", param="tools")
    if choice == "none":
        return None
    if choice == "named" and name not in names:
        raise bad_request(f"tool_choice: names no function among the tools: {name[:64]!r}", param="tool_choice")
    return ToolPlan(tuple(functions), choice, name, parallel_tool_calls is not False)


def _rebased(schema, prefix: str):
    """A copy of ``schema`` whose local ``$ref``s (``#...``) point into ``prefix``, where the schema now sits
    (its depth is bounded by plan_tools)."""
    if isinstance(schema, list):
        return [_rebased(item, prefix) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, item in schema.items():
        if key == "$ref" and isinstance(item, str) and item.startswith("#"):
            out[key] = prefix + item[1:]
        elif key in _LITERALS:
            out[key] = item
        elif key in NAMED_SCHEMAS and isinstance(item, dict):
            out[key] = {name: _rebased(sub, prefix) for name, sub in item.items()}
        else:
            out[key] = _rebased(item, prefix)
    return out


def tool_schema(plan: ToolPlan) -> dict | None:
    """The JSON schema that required / named choices are held to (None for auto)."""
    if plan.choice == "named":
        return plan.parameters(plan.name)
    if plan.choice != "required":
        return None
    call = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
             "properties": {"name": {"const": t["name"]},
                            "arguments": _rebased(t.get("parameters") or {"type": "object"},
                                                  f"#/items/anyOf/{i}/properties/arguments")}}
            for i, t in enumerate(plan.tools)]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
    return schema if plan.parallel else {**schema, "maxItems": 1}


def tool_grammar(plan: ToolPlan) -> str | None:
    """The llguidance grammar of a required / named choice (None for auto), checked like any schema."""
    schema = tool_schema(plan)
    if schema is None:
        return None
    # each tool's parameters are already closed or left open as its ``strict`` says (_function)
    grammar = schema_grammar(schema, "tool_choice", max_depth=MAX_SCHEMA_DEPTH + TOOL_SCHEMA_WRAP_DEPTH,
                             strict=False)
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise bad_request(f"tool_choice: the grammar of the tools exceeds {MAX_GRAMMAR_CHARS} characters",
                          param="tool_choice")
    return grammar


def tools_system_prompt(plan: ToolPlan) -> str:
    listing = "\n".join(json.dumps({"type": "function", "function": t}) for t in plan.tools)
    return ("You can call functions. Their signatures, one JSON object per line, are:\n" + listing + "\n"
            "To call one, reply with <tool_call>{\"name\": <function name>, \"arguments\": <JSON object of "
            "arguments>}</tool_call>" + (", one such block per call." if plan.parallel else " (one call at most).")
            + " Reply in plain text when no call is needed.")


def template_knows_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def resolve_tool_call_parser(name: str, tokenizer) -> str:
    """The ``tool_call_parser`` option: ``auto`` reads the format off a template that renders tools
    (``detect_tool_call_parser``) and is ``hermes`` for one that does not (the system prompt written here
    asks for Hermes blocks); else one of ``TOOL_CALL_PARSERS``. ValueError naming the option."""
    if name == "auto":
        return detect_tool_call_parser(tokenizer.chat_template) if template_knows_tools(tokenizer) else "hermes"
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser: {name!r} is not one of auto, {', '.join(TOOL_CALL_PARSERS)}")
    return name


def with_tools_prompt(messages: list[dict], plan: ToolPlan) -> list[dict]:
    """Messages for a template without tool support: the tool listing joins (or becomes) the system message."""
    prompt = tools_system_prompt(plan)
    if messages and messages[0]["role"] in ("system", "developer"):
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}] + messages[1:]
    return [{"role": "system", "content": prompt}] + messages


_NOT_JSON = object()


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _json(text: str):
    """The JSON value of ``text``, or _NOT_JSON (invalid, NaN / Infinity, nested too deep to parse)."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return _NOT_JSON


def _earlier_call(call, i: int) -> tuple[str, str]:
    """(name, arguments text) of an earlier assistant turn's ``tool_calls[i]``; 400 naming messages."""
    where = f"messages: an assistant turn's tool_calls.{i}"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or call.get("type", "function") != "function" \
            or not isinstance(call.get("id", ""), str):
        raise bad_request(f"{where}: must be {{'id': str, 'type': 'function', 'function': {{'name': str, "
                          "'arguments': str}}}}", param="messages")
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.function.name: must be a non-empty string", param="messages")
    if not isinstance(arguments, (str, type(None))):
        raise bad_request(f"{where}.function.arguments: must be a string (the JSON text of the arguments)",
                          param="messages")
    return name, arguments or "{}"


def calls_as_text(tool_calls: list) -> str:
    """An earlier assistant turn's tool_calls, written in the Hermes form the listing asks for (arguments
    that are not JSON are written as the string they are)."""
    blocks = []
    for i, call in enumerate(tool_calls):
        name, arguments = _earlier_call(call, i)
        value = _json(arguments)
        try:
            block = json.dumps({"name": name, "arguments": arguments if value is _NOT_JSON else value})
        except (ValueError, RecursionError):
            block = json.dumps({"name": name, "arguments": arguments})
        blocks.append(_OPEN + block + _CLOSE)
    return "\n".join(blocks)


def parse_tool_calls(text: str, plan: ToolPlan, parser: str | None = None) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of one choice's whole text: one ``ToolCallStream`` fed all of it, its deltas
    merged (tool_parsers.py; the same result as streaming the text in any pieces); never raises.
    ``parser``: the format (default: the plan's)."""
    stream = ToolCallStream(plan, parser or plan.parser)
    return merge_tool_deltas(stream.feed(text) + stream.finish())
