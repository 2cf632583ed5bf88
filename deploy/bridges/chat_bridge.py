"""What the two APIs built on the chat path share (responses_api.py, messages_api.py).

Each of them translates its request into a ``/v1/chat/completions`` body, lets ``OpenAIService`` run it
(validation, tools, structured output, limits and metrics stay there), and translates the result back.
This module holds the parts both need:

- ``check_fields``: the field rule of these routes. A field the route translates is checked where it is
  translated; a field of the API that this server does not implement is a 400 naming it unless its value
  asks for nothing (``None``, ``False``, ``[]``, ``{}``, or the API's default); a field the API does not
  define is a 400 naming it too (these bodies are translated, so a field nobody reads would be silently
  dropped, which the rule forbids).
- ``renamed``: a chat-path ``APIError`` restated in the route's own field names (``max_tokens`` ->
  ``max_output_tokens``, ``messages`` -> ``input``, ...): the ``param`` and the field named at the start of
  the message; identifiers with an underscore are renamed wherever they stand in the message.
- ``ToolCallPieces``: standard OpenAI streamed tool-call deltas (a call's first delta carries ``index``,
  ``id``, ``function.name`` and maybe the first ``arguments``; later ones ``{"index", "function":
  {"arguments"}}``) -> (call index, is it new, its id, name, arguments piece). A whole call in one delta is
  the same thing with one piece.
- ``named_sse_event``: one server-sent event with its ``event:`` line (both APIs name their events).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from ..openai.errors import APIError, bad_request


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def asks_nothing(value) -> bool:
    return value is None or value is False or value == [] or value == {}


def check_fields(body: dict, translated: frozenset[str],
                 not_implemented: dict[str, tuple[Callable[[object], bool], str]], api: str) -> None:
    """400 naming the first field that is neither translated nor a not-implemented field asking nothing."""
    for name, value in body.items():
        if name in translated:
            continue
        rule = not_implemented.get(name)
        if rule is None:
            raise bad_request(f"{name}: not a field of the {api} API that this server implements", param=name)
        nothing, why = rule
        if not nothing(value):
            raise bad_request(f"{name}: {why}", param=name)


def object_of(value, where: str, param: str, allowed: frozenset[str] | None = None) -> dict:
    """``value`` as a dict (None -> {}); 400 naming ``param`` when it is not an object or holds a key outside
    ``allowed`` whose value asks for something."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"{where}: must be an object", param=param)
    for key, item in value.items():
        if allowed is not None and key not in allowed and not asks_nothing(item):
            raise bad_request(f"{where}.{key}: not supported", param=param)
    return value


def string_of(value, where: str, param: str, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise bad_request(f"{where}: must be a string", param=param)
    return value


def renamed(err: APIError, names: dict[str, str]) -> APIError:
    """``err`` with the chat path's field names replaced by the route's (module docstring)."""
    message, param = err.message, names.get(err.param, err.param) if err.param else err.param
    head = re.match(r"[A-Za-z_]+", message)
    if head and head.group(0) in names and message[head.end():head.end() + 1] in (":", "."):
        message = names[head.group(0)] + message[head.end():]
    for old, new in names.items():
        if "_" in old:
            message = re.sub(rf"\b{old}\b", new, message)
    return APIError(err.status, message, err.err_type, param, err.code, err.headers)


def chat_usage(chat_usage_dict: dict | None) -> tuple[int, int, int, int]:
    """(prompt, completion, cached prompt, reasoning) tokens of a chat ``usage`` object (zeros when absent)."""
    use = chat_usage_dict or {}
    cached = (use.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (use.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return use.get("prompt_tokens") or 0, use.get("completion_tokens") or 0, cached, reasoning


@dataclass
class ToolCallPieces:
    """The calls seen so far in a chat stream: index -> [id, name, arguments so far]."""

    calls: dict[int, list[str]] = field(default_factory=dict)

    def pieces(self, tool_calls: list[dict] | None) -> list[tuple[int, bool, str, str, str]]:
        """(index, new, id, name, arguments piece) for each entry of a delta's ``tool_calls``."""
        out = []
        for position, delta in enumerate(tool_calls or []):
            index = delta.get("index", position)
            function = delta.get("function") or {}
            piece = function.get("arguments") or ""
            new = index not in self.calls
            if new:
                self.calls[index] = [delta.get("id") or new_id("call_"), function.get("name") or "", ""]
            call = self.calls[index]
            call[2] += piece
            out.append((index, new, call[0], call[1], piece))
        return out


class ChatChunkReader:
    """Base of the stream translators (responses_stream.py, messages_stream.py): reads chat chunks, keeps
    the usage, the finish reason and vLLM's ``stop_reason``, and hands each choice's reasoning, content and
    tool-call pieces, in that order, to the subclass's ``_text(kind, piece)`` (kind ``REASONING`` or
    ``CONTENT``) and ``_call_piece(index, new, id, name, piece)``, which return events."""

    REASONING, CONTENT = "reasoning", "content"

    def __init__(self) -> None:
        self.pieces = ToolCallPieces()
        self.finish_reason: str | None = None
        self.matched = None               # vLLM's stop_reason of the chat choice, when the chat path sends it
        self.usage: dict | None = None

    def _text(self, kind: str, piece: str) -> list[dict]:
        raise NotImplementedError

    def _call_piece(self, index: int, new: bool, call_id: str, name: str, piece: str) -> list[dict]:
        raise NotImplementedError

    def chunk(self, chunk: dict) -> list[dict]:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._text(self.REASONING, delta["reasoning_content"])
            if delta.get("content"):
                events += self._text(self.CONTENT, delta["content"])
            for piece in self.pieces.pieces(delta.get("tool_calls")):
                events += self._call_piece(*piece)
            if choice.get("finish_reason"):
                self.finish_reason, self.matched = choice["finish_reason"], choice.get("stop_reason")
        return events


def named_sse_event(name: str, payload: dict) -> str:
    return f"event: {name}\ndata: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False) + "\n\n"
