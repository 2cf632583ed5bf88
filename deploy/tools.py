"""Tool calling on chat: the request's tools -> the prompt (and a grammar); the output -> ``tool_calls``.

- ``tools``: OpenAI function tools (``{"type": "function", "function": {"name", "description",
  "parameters"}}``). A chat template that knows tools (its source mentions ``tools``) renders them
  itself; otherwise a system message written here lists them as JSON and asks for calls in the
  Hermes form ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
- ``tool_choice``: ``"none"`` (tools ignored: no prompt, no parsing), ``"auto"`` (the default: the model
  decides; the text is parsed after generation), ``"required"`` and ``{"type": "function", "function":
  {"name"}}`` (enforced by an llguidance grammar: a JSON array of ``{"name", "arguments"}`` objects
  whose arguments follow each tool's ``parameters``, or, for a named function, its arguments object
  alone, as vLLM does). ``parallel_tool_calls: false`` allows one call.
- Parsing (``auto``): every ``<tool_call>...</tool_call>`` block holding a JSON object with a known
  ``name`` and object ``arguments`` (or ``parameters``) becomes a call; without such blocks, an output
  that is one such JSON object (Llama-3's form) is a call. The rest of the text is the message content
  (``null`` when empty). A block that does not parse stays in the content.
- Calls get ids ``call_<24 hex>``; ``arguments`` is the JSON text of the arguments; the finish reason
  becomes ``"tool_calls"`` when a choice that stopped made calls.
- Streams of a tools request are not incremental: each choice's text is held until it finishes, then
  sent as its content and/or one ``delta.tool_calls`` entry per call (the shape the OpenAI client's
  stream accumulator merges), then the finish reason. Such streams carry no ``logprobs``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .errors import bad_request

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[dict, ...]        # the "function" objects, in request order
    choice: str                    # "auto" | "required" | "named"
    name: str | None = None        # the function of a named choice
    parallel: bool = True

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["name"] for t in self.tools)

    def parameters(self, name: str) -> dict:
        return next(t.get("parameters") or {"type": "object"} for t in self.tools if t["name"] == name)


def plan_tools(tools: list | None, tool_choice, parallel_tool_calls) -> ToolPlan | None:
    """Validated tool request, or None when there is nothing to do (no tools, or ``tool_choice`` "none")."""
    if tool_choice is not None and not (tool_choice in ("none", "auto", "required") or isinstance(tool_choice, dict)):
        raise bad_request("tool_choice: must be 'none', 'auto', 'required' or a named function", param="tool_choice")
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice: needs tools", param="tool_choice")
        return None
    if tool_choice == "none":
        return None
    functions = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not _NAME.fullmatch(function["name"]):
            raise bad_request(f"tools.{i}: must be {{'type': 'function', 'function': {{'name': ...}}}} with a name "
                              "of letters, digits, '_', '.', '-' (at most 64)", param="tools")
        if not isinstance(function.get("parameters", {}), dict):
            raise bad_request(f"tools.{i}.function.parameters: must be a JSON schema object", param="tools")
        functions.append(function)
    if len({f["name"] for f in functions}) != len(functions):
        raise bad_request("tools: function names must be unique", param="tools")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise bad_request("parallel_tool_calls: must be a boolean", param="parallel_tool_calls")
    parallel = parallel_tool_calls is not False
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if name not in {f["name"] for f in functions}:
            raise bad_request(f"tool_choice: names no function among the tools: {name!r}", param="tool_choice")
        return ToolPlan(tuple(functions), "named", name, parallel)
    return ToolPlan(tuple(functions), tool_choice or "auto", None, parallel)


def tool_schema(plan: ToolPlan) -> dict | None:
    """The JSON schema that required / named choices are held to (None for auto)."""
    if plan.choice == "named":
        return plan.parameters(plan.name)
    if plan.choice != "required":
        return None
    call = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
             "properties": {"name": {"const": t["name"]}, "arguments": t.get("parameters") or {"type": "object"}}}
            for t in plan.tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
    return schema if plan.parallel else {**schema, "maxItems": 1}


def tools_system_prompt(plan: ToolPlan) -> str:
    listing = "\n".join(json.dumps({"type": "function", "function": t}) for t in plan.tools)
    return ("You can call functions. Their signatures, one JSON object per line, are:\n" + listing + "\n"
            "To call one, reply with <tool_call>{\"name\": <function name>, \"arguments\": <JSON object of "
            "arguments>}</tool_call>" + (", one such block per call." if plan.parallel else " (one call at most).")
            + " Reply in plain text when no call is needed.")


def template_knows_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def with_tools_prompt(messages: list[dict], plan: ToolPlan) -> list[dict]:
    """Messages for a template without tool support: the tool listing joins (or becomes) the system message."""
    prompt = tools_system_prompt(plan)
    if messages and messages[0]["role"] in ("system", "developer"):
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}] + messages[1:]
    return [{"role": "system", "content": prompt}] + messages


def calls_as_text(tool_calls: list[dict]) -> str:
    """An earlier assistant turn's tool_calls, written in the Hermes form the listing asks for."""
    blocks = []
    for call in tool_calls:
        function = call.get("function") or {}
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except ValueError:
            arguments = function.get("arguments")
        blocks.append("<tool_call>" + json.dumps({"name": function.get("name"), "arguments": arguments})
                      + "</tool_call>")
    return "\n".join(blocks)


def _call(name: str, arguments) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def _as_call(text: str, plan: ToolPlan) -> dict | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in plan.names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return _call(value["name"], arguments) if isinstance(arguments, dict) else None


def parse_tool_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of one choice's text (see the module docstring)."""
    if plan.choice == "named":
        try:
            arguments = json.loads(text)
        except ValueError:
            return text or None, []      # cut short (max_tokens): the text as it is
        return None, [_call(plan.name, arguments)]
    if plan.choice == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text or None, []
        return None, [_call(item["name"], item["arguments"]) for item in items]
    calls, kept, last = [], [], 0
    for match in _BLOCK.finditer(text):
        call = _as_call(match.group(1), plan)
        if call is not None:
            kept.append(text[last:match.start()])
            last = match.end()
            calls.append(call)
    if calls:
        content = ("".join(kept) + text[last:]).strip()
        return content or None, calls if plan.parallel else calls[:1]
    whole = _as_call(text.strip(), plan)
    if whole is not None:
        return None, [whole]
    return text, []
