"""Anthropic Messages API (``POST /v1/messages``) on the chat path: request -> chat body, chat response ->
Message, errors in Anthropic's shape (the stream's events: messages_stream.py).

Translated (each malformed value is a 400 naming the Messages field):
- ``max_tokens`` (required), ``model``, ``temperature``, ``top_p``, ``top_k``, ``stop_sequences`` (-> ``stop``),
  ``metadata.user_id`` (-> ``user``), ``stream``.
- ``system``: a string or text blocks -> a system message first.
- ``messages``: role user / assistant; content a string or blocks: ``text``; ``tool_use`` (an assistant
  turn's ``tool_calls``, ``input`` written as JSON); ``tool_result`` (a ``tool`` message answering
  ``tool_use_id``; content a string or text blocks; ``is_error: true`` prefixes the text with "Error: ");
  ``thinking`` / ``redacted_thinking`` blocks of earlier assistant turns are dropped (chat templates drop
  earlier reasoning too). Images, documents and other block types are a 400. A last assistant message is a
  prefill: the model continues it (chat's ``continue_final_message``). ``cache_control`` and ``citations``
  on blocks are accepted without effect (the prefix cache is automatic).
- ``tools``: client tools ``{"name", "description", "input_schema", "strict"}`` -> chat function tools
  (strict by default, as on chat: keys the schema does not list are refused unless ``strict: false``;
  Anthropic's own API is lax by default, which lets small models run off with extra keys); server tools are
  a 400.
  ``tool_choice``: ``auto`` / ``any`` (-> required) / ``tool`` with ``name`` / ``none``;
  ``disable_parallel_tool_use: true`` -> ``parallel_tool_calls: false``.
- ``thinking``: ``{"type": "enabled", "budget_tokens": N}`` -> ``chat_template_kwargs.enable_thinking:
  true``; ``{"type": "disabled"}`` -> false; ``{"type": "adaptive"}`` -> the template's default.
  ``budget_tokens`` must be a positive integer but is not enforced: thinking and answer share
  ``max_tokens`` (a template has no budget knob).
- ``output_config.format`` ``{"type": "json_schema", "schema"}`` -> chat ``response_format``.
- Accepted without effect: ``service_tier``, top-level ``cache_control``; ``container``, ``mcp_servers``,
  ``context_management``, ``inference_geo``, ``diagnostics``, ``speed`` other than "standard" and
  ``output_config.effort`` are a 400 naming the field when they ask for something; any other field too.

Output: ``{"id": "msg_...", "type": "message", "role": "assistant", "model", "content": [thinking block
(from ``reasoning_content``; ``signature`` empty), text block, tool_use blocks (``id`` "toolu_...",
``name``, ``input`` the parsed arguments)], "stop_reason", "stop_sequence", "usage"}``. ``stop_reason``:
chat "length" -> ``max_tokens``, "tool_calls" -> ``tool_use``, "stop" -> ``end_turn``, or
``stop_sequence`` with the matched string the chat choice names in vLLM's ``stop_reason``. Usage:
``input_tokens`` are the prompt tokens not read from the prefix cache, ``cache_read_input_tokens`` those
that were.

Errors: ``{"type": "error", "error": {"type", "message"}}`` with the status the chat route would answer;
``error.type`` from the status (``ERROR_TYPES``); chat field names restated (``CHAT_NAMES``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..openai.errors import APIError, bad_request
from .chat_bridge import asks_nothing, chat_usage, check_fields, new_id, object_of, string_of

API = "Anthropic Messages"
CHAT_NAMES = {"stop": "stop_sequences", "chat_template_kwargs": "thinking", "user": "metadata",
              "response_format": "output_config", "continue_final_message": "messages"}
TRANSLATED = frozenset({"model", "max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences",
                        "temperature", "top_p", "top_k", "metadata", "stream", "thinking", "output_config"})
NOT_IMPLEMENTED = {
    "service_tier": (lambda v: True, ""), "cache_control": (lambda v: True, ""),
    "container": (asks_nothing, "containers are not supported"),
    "mcp_servers": (asks_nothing, "MCP servers are not supported"),
    "context_management": (asks_nothing, "not supported"), "inference_geo": (asks_nothing, "not supported"),
    "diagnostics": (asks_nothing, "not supported"),
    "speed": (lambda v: v in (None, "standard"), "only 'standard'"),
}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}
_TEXT_KEYS = frozenset({"type", "text", "cache_control", "citations"})


@dataclass
class MessagesCall:
    chat_body: dict
    stream: bool
    stop_sequences: tuple[str, ...]


def error_body(err: APIError) -> dict:
    kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def _blocks_text(content, where: str) -> str:
    """A string, or text blocks joined (a system prompt, a tool result)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{where}: must be a string or a list of text blocks", param=where.split(".")[0])
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else None
            raise bad_request(f"{where}.{j}: only text blocks are supported, got {kind!r}", param=where.split(".")[0])
        texts.append(_text_block(block, f"{where}.{j}", where.split(".")[0]))
    return "".join(texts)


def _text_block(block: dict, where: str, param: str = "messages") -> str:
    object_of(block, where, param, _TEXT_KEYS)
    return string_of(block.get("text"), f"{where}.text", param)


def _tool_use(block: dict, where: str) -> dict:
    object_of(block, where, "messages", frozenset({"type", "id", "name", "input", "cache_control"}))
    call_id = string_of(block.get("id"), f"{where}.id", "messages")
    name = string_of(block.get("name"), f"{where}.name", "messages")
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise bad_request(f"{where}.input: must be an object", param="messages")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def _assistant(content: list, where: str) -> dict:
    texts, calls = [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text_block(block, f"{where}.{j}"))
        elif kind == "tool_use":
            calls.append(_tool_use(block, f"{where}.{j}"))
        elif kind not in ("thinking", "redacted_thinking"):
            raise bad_request(f"{where}.{j}.type: an assistant turn holds text, tool_use and thinking blocks, "
                              f"got {kind!r}", param="messages")
    message = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    return {**message, "tool_calls": calls} if calls else message


def _tool_result(block: dict, where: str) -> dict:
    object_of(block, where, "messages", frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"}))
    call_id = string_of(block.get("tool_use_id"), f"{where}.tool_use_id", "messages")
    text = _blocks_text(block.get("content"), f"{where}.content")
    if block.get("is_error") is not None and not isinstance(block["is_error"], bool):
        raise bad_request(f"{where}.is_error: must be a boolean", param="messages")
    if block.get("is_error") is True:
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _user(content: list, where: str) -> list[dict]:
    """A user turn's blocks, in order: runs of text -> user messages, tool results -> tool messages."""
    out, texts = [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text_block(block, f"{where}.{j}"))
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": "".join(texts)})
                texts = []
            out.append(_tool_result(block, f"{where}.{j}"))
        else:
            raise bad_request(f"{where}.{j}.type: a user turn holds text and tool_result blocks (text only: no "
                              f"images or documents), got {kind!r}", param="messages")
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def chat_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages: must be a non-empty list of messages", param="messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role: must be 'user' or 'assistant'", param="messages")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise bad_request(f"{where}.content: must be a string or a list of blocks", param="messages")
        elif role == "assistant":
            out.append(_assistant(content, f"{where}.content"))
        else:
            out.extend(_user(content, f"{where}.content"))
    return out


def chat_tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools: must be a list of tools", param="tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else "?"
        if kind not in (None, "custom"):
            raise bad_request(f"tools.{i}.type: only client tools ({{'name', 'description', 'input_schema'}}) are "
                              f"supported, got {kind!r}", param="tools")
        object_of(tool, f"tools.{i}", "tools",
                  frozenset({"type", "name", "description", "input_schema", "cache_control", "strict"}))
        function = {"name": tool.get("name"), "description": tool.get("description"),
                    "parameters": tool.get("input_schema"), "strict": tool.get("strict")}
        out.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return out


def chat_tool_choice(choice) -> tuple[object, bool | None]:
    """(chat tool_choice, chat parallel_tool_calls) of Anthropic's ``tool_choice``."""
    if choice is None:
        return None, None
    choice = object_of(choice, "tool_choice", "tool_choice", frozenset({"type", "name", "disable_parallel_tool_use"}))
    kind, disable = choice.get("type"), choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise bad_request("tool_choice.disable_parallel_tool_use: must be a boolean", param="tool_choice")
    parallel = False if disable else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        name = string_of(choice.get("name"), "tool_choice.name", "tool_choice")
        return {"type": "function", "function": {"name": name}}, parallel
    raise bad_request("tool_choice.type: must be 'auto', 'any', 'tool' or 'none'", param="tool_choice")


def thinking_kwargs(thinking) -> dict | None:
    if thinking is None:
        return None
    thinking = object_of(thinking, "thinking", "thinking", frozenset({"type", "budget_tokens", "display"}))
    kind = thinking.get("type")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise bad_request("thinking.budget_tokens: must be a positive integer", param="thinking")
        return {"enable_thinking": True}
    if kind == "disabled":
        return {"enable_thinking": False}
    if kind == "adaptive":
        return None
    raise bad_request("thinking.type: must be 'enabled', 'disabled' or 'adaptive'", param="thinking")


def response_format(output_config) -> dict | None:
    config = object_of(output_config, "output_config", "output_config", frozenset({"format"}))
    fmt = object_of(config.get("format"), "output_config.format", "output_config", frozenset({"type", "schema"}))
    if not fmt:
        return None
    if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request("output_config.format: must be {'type': 'json_schema', 'schema': {...}}",
                          param="output_config")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _stop_sequences(value) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad_request("stop_sequences: must be a list of strings", param="stop_sequences")
    return value or None


def to_chat(body) -> MessagesCall:
    """A Messages request body -> the chat body that runs it (module docstring); 400 naming the field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_fields(body, TRANSLATED, NOT_IMPLEMENTED, API)
    if body.get("max_tokens") is None:
        raise bad_request("max_tokens: required", param="max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream: must be a boolean", param="stream")
    system = _blocks_text(body.get("system"), "system")
    messages = ([{"role": "system", "content": system}] if system else []) + chat_messages(body.get("messages"))
    metadata = object_of(body.get("metadata"), "metadata", "metadata", frozenset({"user_id"}))
    tool_choice, parallel = chat_tool_choice(body.get("tool_choice"))
    stops = _stop_sequences(body.get("stop_sequences"))
    chat = {"messages": messages, "model": body.get("model"), "max_tokens": body["max_tokens"],
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "top_k": body.get("top_k"),
            "stop": stops, "user": string_of(metadata.get("user_id"), "metadata.user_id", "metadata", True),
            "tools": chat_tools(body.get("tools")), "tool_choice": tool_choice, "parallel_tool_calls": parallel,
            "chat_template_kwargs": thinking_kwargs(body.get("thinking")),
            "response_format": response_format(body.get("output_config"))}
    chat = {key: value for key, value in chat.items() if value is not None}
    if messages[-1]["role"] == "assistant":       # a prefill: the model continues it
        chat.update(continue_final_message=True, add_generation_prompt=False)
    if stream:
        chat.update(stream=True, stream_options={"include_usage": True})
    return MessagesCall(chat, stream, tuple(stops or ()))


def tool_use_id(chat_call_id: str) -> str:
    return "toolu_" + chat_call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict:
    """A call's arguments as an object (the chat path writes them with json.dumps of an object)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_of(finish_reason: str | None, matched, call: MessagesCall) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat finish reason (module docstring)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(matched, str) and matched in call.stop_sequences:
        return "stop_sequence", matched
    return "end_turn", None


def usage(chat_use: dict | None) -> dict:
    prompt, completion, cached, _ = chat_usage(chat_use)
    return {"input_tokens": prompt - cached, "output_tokens": completion, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


def from_chat(chat: dict, call: MessagesCall) -> dict:
    """A chat.completion -> the Message (module docstring)."""
    choice = chat["choices"][0]
    message = choice["message"]
    content = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for tool_call in message.get("tool_calls") or []:
        function = tool_call["function"]
        content.append({"type": "tool_use", "id": tool_use_id(tool_call["id"]), "name": function["name"],
                        "input": tool_input(function["arguments"])})
    stop_reason, stop_sequence = stop_of(choice.get("finish_reason"), choice.get("stop_reason"), call)
    return {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": chat["model"],
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": usage(chat.get("usage"))}
