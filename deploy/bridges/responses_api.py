"""OpenAI Responses API (``POST /v1/responses``), stateless, on the chat path: request -> chat body, chat
response -> Response object (the stream's events: responses_stream.py).

Translated (each malformed value is a 400 naming the Responses field):
- ``input``: a string (one user message) or a list of items: ``message`` items (``type`` may be left out;
  role user / system / developer / assistant; content a string or ``input_text`` / ``output_text`` parts),
  ``function_call`` items (``call_id``, ``name``, ``arguments``; consecutive ones, and one right after an
  assistant message, join that assistant turn's ``tool_calls``) and ``function_call_output`` items
  (``call_id``, ``output`` a string or text parts) -> ``tool`` messages. ``reasoning`` items are dropped
  (chat templates drop earlier turns' reasoning too). Images, files, audio and other item types are a 400.
- ``instructions`` -> a system message before the input.
- ``tools``: Responses' flat function tools ``{"type": "function", "name", "description", "parameters",
  "strict"}`` -> chat tools (other tool types are a 400); ``tool_choice`` (``none`` / ``auto`` /
  ``required`` / ``{"type": "function", "name"}``), ``parallel_tool_calls``.
- ``text.format``: ``text`` / ``json_object`` / ``json_schema`` (``name``, ``schema``, ``strict``) -> chat
  ``response_format``; ``text.verbosity`` only ``medium`` (the default) or null.
- ``max_output_tokens`` -> ``max_tokens``; ``temperature``, ``top_p``, ``user`` as they are; ``metadata``
  (an object) is echoed in the response.
- ``reasoning.effort`` -> ``chat_template_kwargs.enable_thinking``: ``"none"`` -> false, ``"minimal"``,
  ``"low"``, ``"medium"``, ``"high"``, ``"xhigh"`` -> true (a template has no finer knob; a template without
  ``enable_thinking`` ignores it), null -> the template's default. ``reasoning.summary``: null or ``auto``
  (no summary is written: a reasoning item carries the model's reasoning text as ``content``).
- Stateless: ``store: true``, ``previous_response_id``, ``conversation``, ``background: true`` are a 400
  naming the field; so are ``include``, ``prompt``, ``top_logprobs``, ``max_tool_calls``, ``truncation:
  "auto"``, ``stream_options.include_obfuscation: true``, ``prompt_cache_retention`` and
  ``context_management`` with a value that asks for something. ``prompt_cache_key`` names the session whose
  blocks stay cached (chat's field of that name). Accepted without effect: ``service_tier``,
  ``safety_identifier``. Any other field is a 400 naming it (chat_bridge.py).

Output: ``{"id": "resp_...", "object": "response", "created_at", "status": "completed" | "incomplete"
(with ``incomplete_details.reason`` "max_output_tokens" when the output was cut at the limit), "model",
"output": [reasoning item (from the chat message's ``reasoning_content``), message item (``output_text``),
function_call items (``call_id``, ``name``, ``arguments``)], "usage": {input_tokens,
input_tokens_details.cached_tokens, output_tokens, output_tokens_details.reasoning_tokens, total_tokens}}``
and the request's settings echoed (``instructions``, ``tools``, ``tool_choice``, ``text``, ...).
Chat-path errors keep their status and are restated in these field names (``CHAT_NAMES``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..openai.errors import bad_request
from .chat_bridge import asks_nothing, chat_usage, check_fields, new_id, object_of, string_of

API = "Responses"
CHAT_NAMES = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text",
              "chat_template_kwargs": "reasoning", "stream_options": "stream"}
TRANSLATED = frozenset({"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
                        "max_output_tokens", "temperature", "top_p", "reasoning", "metadata", "user", "stream"})
_STATELESS = "this server keeps no responses (stateless): send the whole conversation in input"
NOT_IMPLEMENTED = {
    "store": (asks_nothing, _STATELESS), "previous_response_id": (asks_nothing, _STATELESS),
    "conversation": (asks_nothing, _STATELESS), "background": (asks_nothing, "background responses need a store"),
    "include": (asks_nothing, "no extra output data is available"),
    "prompt": (asks_nothing, "stored prompt templates are not supported"),
    "top_logprobs": (lambda v: v in (None, 0), "logprobs are not supported on this route"),
    "max_tool_calls": (asks_nothing, "not supported"),
    "truncation": (lambda v: v in (None, "disabled"), "only 'disabled' (an input too long is a 400)"),
    "stream_options": (lambda v: asks_nothing(v) or v == {"include_obfuscation": False},
                       "only include_obfuscation: false"),
    "prompt_cache_retention": (asks_nothing, "the prefix cache is managed by the server"),
    "context_management": (asks_nothing, "not supported"),
    "service_tier": (lambda v: True, ""), "prompt_cache_key": (lambda v: True, ""),
    "safety_identifier": (lambda v: True, ""),
}
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


@dataclass
class ResponsesCall:
    """A translated request: the chat body, whether it streams, and what the response echoes."""

    chat_body: dict
    stream: bool
    echo: dict


def _text(content, where: str, kinds: tuple[str, ...]) -> str:
    """A message's content (a string or text parts of ``kinds``) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: must be a string or a list of content parts", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            raise bad_request(f"{where}.{j}: only text parts ({', '.join(kinds)}) are supported, got {kind!r}",
                              param="input")
        texts.append(string_of(part.get("text"), f"{where}.{j}.text", "input"))
    return "".join(texts)


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise bad_request(f"{where}.role: must be 'user', 'system', 'developer' or 'assistant'", param="input")
    return {"role": role, "content": _text(item.get("content"), f"{where}.content", ("input_text", "output_text"))}


def _function_call(item: dict, where: str) -> dict:
    name = string_of(item.get("name"), f"{where}.name", "input")
    arguments = string_of(item.get("arguments"), f"{where}.arguments", "input")
    call_id = string_of(item.get("call_id"), f"{where}.call_id", "input")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def input_messages(value) -> list[dict]:
    """``input`` -> chat messages (module docstring)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("input: must be a string or a non-empty list of items", param="input")
    messages: list[dict] = []
    for i, item in enumerate(value):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise bad_request(f"{where}: must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_call_id" not in last:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = string_of(item.get("call_id"), f"{where}.call_id", "input")
            output = _text(item.get("output"), f"{where}.output", ("input_text", "output_text"))
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind != "reasoning":
            raise bad_request(f"{where}.type: {kind!r} items are not supported (message, function_call, "
                              "function_call_output, reasoning)", param="input")
    return messages


def chat_tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools: must be a list of function tools", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"tools.{i}.type: only function tools are supported, got {kind!r}", param="tools")
        object_of(tool, f"tools.{i}", "tools", frozenset({"type", "name", "description", "parameters", "strict"}))
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice      # "none" / "auto" / "required"; the chat path refuses any other string
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice: must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                      param="tool_choice")


def response_format(text) -> dict | None:
    text = object_of(text, "text", "text", frozenset({"format", "verbosity"}))
    if text.get("verbosity") not in (None, "medium"):
        raise bad_request("text.verbosity: only 'medium' (the default)", param="text")
    fmt = object_of(text.get("format"), "text.format", "text")
    kind = fmt.get("type")
    if not fmt or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise bad_request(f"text.format.type: must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                      param="text")


def thinking_kwargs(reasoning) -> dict | None:
    reasoning = object_of(reasoning, "reasoning", "reasoning", frozenset({"effort", "summary", "generate_summary"}))
    for key in ("summary", "generate_summary"):
        if reasoning.get(key) not in (None, "auto"):
            raise bad_request(f"reasoning.{key}: only 'auto' or null (no summary is written; the reasoning "
                              "item carries the reasoning text)", param="reasoning")
    effort = reasoning.get("effort")
    if effort is None:
        return None
    if effort not in EFFORTS:
        raise bad_request(f"reasoning.effort: must be one of {', '.join(EFFORTS)}", param="reasoning")
    return {"enable_thinking": effort != "none"}


def to_chat(body) -> ResponsesCall:
    """A Responses request body -> the chat body that runs it (module docstring); 400 naming the field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_fields(body, TRANSLATED, NOT_IMPLEMENTED, API)
    if "input" not in body:
        raise bad_request("input: required", param="input")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream: must be a boolean", param="stream")
    if body.get("parallel_tool_calls") is not None and not isinstance(body["parallel_tool_calls"], bool):
        raise bad_request("parallel_tool_calls: must be a boolean", param="parallel_tool_calls")
    metadata = object_of(body.get("metadata"), "metadata", "metadata")
    instructions = string_of(body.get("instructions"), "instructions", "instructions", optional=True)
    messages = ([{"role": "system", "content": instructions}] if instructions is not None else []) \
        + input_messages(body["input"])
    chat = {"messages": messages, "model": body.get("model"), "max_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "user": body.get("user"),
            "tools": chat_tools(body.get("tools")), "tool_choice": chat_tool_choice(body.get("tool_choice")),
            "parallel_tool_calls": body.get("parallel_tool_calls"),
            "response_format": response_format(body.get("text")),
            "chat_template_kwargs": thinking_kwargs(body.get("reasoning")),
            "prompt_cache_key": body.get("prompt_cache_key")}
    chat = {key: value for key, value in chat.items() if value is not None}
    if stream:
        chat.update(stream=True, stream_options={"include_usage": True})
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "metadata": metadata, "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"), "summary": None},
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "text": body.get("text") or {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [], "user": body.get("user")}
    return ResponsesCall(chat, stream, echo)


def response_shell(call: ResponsesCall, rid: str, created: int, model: str, status: str) -> dict:
    """The Response object without output and usage (also the stream's response.created)."""
    return {"id": rid, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": None, "model": model, "output": [], "previous_response_id": None,
            "store": False, "truncation": "disabled", "usage": None, **call.echo}


def usage(chat_use: dict | None) -> dict:
    prompt, completion, cached, reasoning = chat_usage(chat_use)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": reasoning}, "total_tokens": prompt + completion}


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"id": item_id or new_id("rs_"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text else [], "status": status}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"id": item_id or new_id("msg_"), "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)] if text else []}


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed",
                       item_id: str | None = None) -> dict:
    return {"id": item_id or new_id("fc_"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def finished(response: dict, finish_reason: str | None) -> dict:
    """``response`` with its final status: cut at the token limit -> incomplete (max_output_tokens)."""
    if finish_reason == "length":
        return {**response, "status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
    return {**response, "status": "completed"}


def from_chat(chat: dict, call: ResponsesCall) -> dict:
    """A chat.completion -> the Response object (module docstring)."""
    choice = chat["choices"][0]
    message, finish = choice["message"], choice.get("finish_reason")
    status = "incomplete" if finish == "length" else "completed"
    output = []
    if message.get("reasoning_content"):
        output.append(reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        output.append(message_item(message["content"], status))
    for tool_call in message.get("tool_calls") or []:
        function = tool_call["function"]
        output.append(function_call_item(tool_call["id"], function["name"], function["arguments"]))
    response = response_shell(call, new_id("resp_"), chat["created"], chat["model"], status)
    return finished({**response, "output": output, "usage": usage(chat.get("usage"))}, finish)
