"""The Responses API's stream (``POST /v1/responses`` with ``stream: true``) from a chat chunk stream.

Events, each with its ``sequence_number`` (0, 1, ...) and sent with an ``event:`` line naming its type:
``response.created`` and ``response.in_progress`` (when the first chat chunk arrives: it carries the
model's name), then per output item ``response.output_item.added``, its content, ``response.output_item.done``,
and last ``response.completed`` (or ``response.incomplete`` when the output was cut at
``max_output_tokens``) with the whole Response, usage included.

- ``delta.reasoning_content`` pieces -> a ``reasoning`` item: ``response.content_part.added`` (a
  ``reasoning_text`` part), ``response.reasoning_text.delta`` ..., ``response.reasoning_text.done``,
  ``response.content_part.done``.
- ``delta.content`` pieces -> a ``message`` item: ``response.content_part.added`` (``output_text``),
  ``response.output_text.delta`` ..., ``response.output_text.done``, ``response.content_part.done``.
- ``delta.tool_calls`` (standard OpenAI deltas: chat_bridge.ToolCallPieces; a whole call in one delta is one
  piece) -> one ``function_call`` item per call, opened at the call's first delta:
  ``response.function_call_arguments.delta`` per arguments piece, ``response.function_call_arguments.done``.
A reasoning or message item ends when the other kind of text or a call begins; calls end when the chat
stream ends (so pieces of several calls may interleave), all in output order.

An error after the stream started (an engine failure) ends it with an ``error`` event (the chat path's
``code``, ``message``, ``param``) and ``response.failed`` (its ``error.code`` one of the Responses codes:
``rate_limit_exceeded`` for a 429, ``invalid_prompt`` for another 4xx, ``server_error``); nothing follows.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..openai.errors import APIError, to_api_error
from .chat_bridge import ChatChunkReader, new_id
from .responses_api import (
    ResponsesCall,
    finished,
    function_call_item,
    message_item,
    reasoning_item,
    response_shell,
    text_part,
    usage,
)

_PREFIX = {"reasoning": "rs_", "message": "msg_", "function_call": "fc_"}


@dataclass
class _Item:
    kind: str              # "reasoning" | "message" | "function_call"
    output_index: int
    id: str
    text: str = ""         # the reasoning or message text, or the call's arguments
    call_id: str = ""
    name: str = ""
    final: dict | None = None    # the item as output_item.done sent it

    def snapshot(self, status: str) -> dict:
        if self.kind == "reasoning":
            return reasoning_item(self.text, status, self.id)
        if self.kind == "message":
            return message_item(self.text, status, self.id)
        return function_call_item(self.call_id, self.name, self.text, status, self.id)


class ResponseEvents(ChatChunkReader):
    """One streamed response's state: chat chunks in, Responses events (payload dicts) out."""

    REASONING, CONTENT = "reasoning", "message"   # the kinds _text gets

    def __init__(self, call: ResponsesCall, created: int, model: str) -> None:
        super().__init__()
        self.seq = 0
        self.items: list[_Item] = []
        self.open_text: _Item | None = None
        self.calls: dict[int, _Item] = {}
        self.shell = response_shell(call, new_id("resp_"), created, model, "in_progress")

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self.shell),
                self._event("response.in_progress", response=self.shell)]

    def _add(self, kind: str, call_id: str = "", name: str = "") -> tuple[_Item, list[dict]]:
        item = _Item(kind, len(self.items), new_id(_PREFIX[kind]), call_id=call_id, name=name)
        self.items.append(item)
        events = [self._event("response.output_item.added", output_index=item.output_index,
                              item=item.snapshot("in_progress"))]
        if kind != "function_call":
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else text_part("")
            events.append(self._event("response.content_part.added", item_id=item.id,
                                      output_index=item.output_index, content_index=0, part=part))
        return item, events

    def _close(self, item: _Item, status: str = "completed") -> list[dict]:
        where = {"item_id": item.id, "output_index": item.output_index}
        if item.kind == "function_call":
            events = [self._event("response.function_call_arguments.done", **where, name=item.name,
                                  arguments=item.text)]
        elif item.kind == "reasoning":
            events = [self._event("response.reasoning_text.done", **where, content_index=0, text=item.text),
                      self._event("response.content_part.done", **where, content_index=0,
                                  part={"type": "reasoning_text", "text": item.text})]
        else:
            events = [self._event("response.output_text.done", **where, content_index=0, text=item.text,
                                  logprobs=[]),
                      self._event("response.content_part.done", **where, content_index=0, part=text_part(item.text))]
        item.final = item.snapshot(status)
        events.append(self._event("response.output_item.done", output_index=item.output_index, item=item.final))
        return events

    def _text(self, kind: str, piece: str) -> list[dict]:
        events = []
        item = self.open_text
        if item is None or item.kind != kind:
            events += self._close(item) if item is not None else []
            item, added = self._add(kind)
            events += added
            self.open_text = item
        item.text += piece
        where = {"item_id": item.id, "output_index": item.output_index, "content_index": 0, "delta": piece}
        if kind == "reasoning":
            return events + [self._event("response.reasoning_text.delta", **where)]
        return events + [self._event("response.output_text.delta", **where, logprobs=[])]

    def _call_piece(self, index: int, new: bool, call_id: str, name: str, piece: str) -> list[dict]:
        events = []
        if new:
            if self.open_text is not None:
                events += self._close(self.open_text)
                self.open_text = None
            item, added = self._add("function_call", call_id, name)
            self.calls[index] = item
            events += added
        item = self.calls[index]
        item.text += piece
        if piece:
            events.append(self._event("response.function_call_arguments.delta", item_id=item.id,
                                      output_index=item.output_index, delta=piece))
        return events


    def end(self) -> list[dict]:
        status = "incomplete" if self.finish_reason == "length" else "completed"
        events = []
        for item in self.items:
            if item.final is None:
                events += self._close(item, status)
        response = finished({**self.shell, "output": [item.final for item in self.items],
                             "usage": usage(self.usage)}, self.finish_reason)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return events + [self._event(kind, response=response)]

    def failed(self, err: APIError) -> list[dict]:
        code = err.code if isinstance(err.code, str) else err.err_type
        output = [item.final for item in self.items if item.final is not None]
        kind = "rate_limit_exceeded" if err.status == 429 else "invalid_prompt" if err.status < 500 else "server_error"
        response = {**self.shell, "status": "failed", "output": output,
                    "error": {"code": kind, "message": err.message}}
        return [self._event("error", code=code, message=err.message, param=err.param),
                self._event("response.failed", response=response)]


async def response_events(chunks, call: ResponsesCall) -> AsyncIterator[dict]:
    """A chat chunk stream (``OpenAIService.open_chat_stream``) -> the Responses events; closes ``chunks``."""
    state: ResponseEvents | None = None
    try:
        async for chunk in chunks:
            if state is None:
                state = ResponseEvents(call, chunk.get("created") or int(time.time()), chunk.get("model") or "")
                for event in state.start():
                    yield event
            for event in state.chunk(chunk):
                yield event
        if state is None:
            state = ResponseEvents(call, int(time.time()), call.chat_body.get("model") or "")
            for event in state.start():
                yield event
        for event in state.end():
            yield event
    except Exception as exc:  # noqa: BLE001 - the status is already sent: report in-band
        events = []
        if state is None:   # the stream still opens with response.created, as clients expect
            state = ResponseEvents(call, int(time.time()), call.chat_body.get("model") or "")
            events = state.start()
        for event in events + state.failed(to_api_error(exc)):
            yield event
    finally:
        await chunks.aclose()
