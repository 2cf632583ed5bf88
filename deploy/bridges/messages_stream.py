"""The Anthropic Messages stream (``POST /v1/messages`` with ``stream: true``) from a chat chunk stream.

Events, each sent with an ``event:`` line naming its ``type``: ``message_start`` (when the first chat chunk
arrives; its usage is zero: the prompt's size is known at the end), then content blocks one at a time
(``content_block_start``, ``content_block_delta`` ..., ``content_block_stop``; ``index`` counts the blocks),
``message_delta`` (``stop_reason``, ``stop_sequence`` and the whole usage, input tokens included) and
``message_stop``. No ``ping`` events.

- ``delta.reasoning_content`` pieces -> a ``thinking`` block (``thinking_delta``; its ``signature`` stays
  empty: there is nothing to sign).
- ``delta.content`` pieces -> a ``text`` block (``text_delta``).
- ``delta.tool_calls`` (standard OpenAI deltas, chat_bridge.ToolCallPieces) -> one ``tool_use`` block per
  call (``id`` "toolu_...", ``name``, ``input`` {}), started at the call's first delta, its arguments
  pieces as ``input_json_delta``. A block stops when the next one starts. OpenAI streams send each call's
  pieces before the next call starts; a piece that comes later anyway is still sent, as a delta at its
  call's index (Anthropic's client accumulates by index), so no argument text is lost.

An error after the stream started ends it with an ``error`` event in Anthropic's error shape.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from ..openai.errors import to_api_error
from .chat_bridge import ChatChunkReader, new_id
from .messages_api import MessagesCall, error_body, stop_of, tool_use_id, usage


class MessageEvents(ChatChunkReader):
    """One streamed message's state: chat chunks in, Messages events (payload dicts) out."""

    REASONING, CONTENT = "thinking", "text"   # the kinds _text gets

    def __init__(self, call: MessagesCall, model: str) -> None:
        super().__init__()
        self.call, self.model = call, model
        self.blocks = 0                   # blocks started so far
        self.open: tuple[str, int] | None = None    # (kind, index) of the block being written
        self.call_blocks: dict[int, int] = {}        # chat tool-call index -> block index

    def start(self) -> list[dict]:
        message = {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": 0, "output_tokens": 0}}
        return [{"type": "message_start", "message": message}]

    def _stop_open(self) -> list[dict]:
        if self.open is None:
            return []
        index, self.open = self.open[1], None
        return [{"type": "content_block_stop", "index": index}]

    def _begin(self, kind: str, block: dict) -> list[dict]:
        events = self._stop_open()
        self.open = (kind, self.blocks)
        self.blocks += 1
        return events + [{"type": "content_block_start", "index": self.open[1], "content_block": block}]

    def _text(self, kind: str, piece: str) -> list[dict]:
        events = []
        if self.open is None or self.open[0] != kind:
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            events = self._begin(kind, block)
        delta = {"type": "thinking_delta", "thinking": piece} if kind == "thinking" else \
            {"type": "text_delta", "text": piece}
        return events + [{"type": "content_block_delta", "index": self.open[1], "delta": delta}]

    def _call_piece(self, index: int, new: bool, call_id: str, name: str, piece: str) -> list[dict]:
        events = []
        if new:
            events = self._begin("tool_use", {"type": "tool_use", "id": tool_use_id(call_id), "name": name,
                                              "input": {}})
            self.call_blocks[index] = self.open[1]
        if piece:
            events.append({"type": "content_block_delta", "index": self.call_blocks[index],
                           "delta": {"type": "input_json_delta", "partial_json": piece}})
        return events


    def end(self) -> list[dict]:
        stop_reason, stop_sequence = stop_of(self.finish_reason, self.matched, self.call)
        return self._stop_open() + [
            {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
             "usage": usage(self.usage)},
            {"type": "message_stop"}]


async def message_events(chunks, call: MessagesCall) -> AsyncIterator[dict]:
    """A chat chunk stream (``OpenAIService.open_chat_stream``) -> the Messages events; closes ``chunks``."""
    state: MessageEvents | None = None
    try:
        async for chunk in chunks:
            if state is None:
                state = MessageEvents(call, chunk.get("model") or "")
                for event in state.start():
                    yield event
            for event in state.chunk(chunk):
                yield event
        if state is None:
            state = MessageEvents(call, call.chat_body.get("model") or "")
            for event in state.start():
                yield event
        for event in state.end():
            yield event
    except Exception as exc:  # noqa: BLE001 - the status is already sent: report in-band
        yield error_body(to_api_error(exc))
    finally:
        await chunks.aclose()
