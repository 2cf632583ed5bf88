"""TEST DOUBLE of ``OpenAIService``'s chat side for the Responses / Messages routes: it answers every chat
request with a hand-made chat.completion or chat.completion.chunk sequence, in the shapes the chat path
sends (reasoning_content, standard OpenAI tool-call deltas in several pieces, a usage chunk), and records
the chat bodies it was given. ``create_api`` needs nothing else of the service for these two routes."""

from __future__ import annotations

from pagedray.cluster.outputs import EngineError

CREATED = 1_700_000_000
USAGE = {"prompt_tokens": 20, "completion_tokens": 12, "total_tokens": 32,
         "prompt_tokens_details": {"cached_tokens": 4}, "completion_tokens_details": {"reasoning_tokens": 5}}


def chunk(delta: dict | None = None, finish: str | None = None, usage: dict | None = None, **choice) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                                         **choice}]
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": CREATED, "model": "fake-model",
            "choices": choices, "usage": usage}


def call_start(index: int, call_id: str, name: str, arguments: str = "") -> dict:
    return {"tool_calls": [{"index": index, "id": call_id, "type": "function",
                            "function": {"name": name, "arguments": arguments}}]}


def call_piece(index: int, arguments: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}


# reasoning, text, then two calls whose arguments arrive in pieces, then usage
REASONED_CALLS = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"reasoning_content": "The user wants "}), chunk({"reasoning_content": "the weather."}),
    chunk({"content": "Checking"}), chunk({"content": " now."}),
    chunk(call_start(0, "call_a", "get_weather")), chunk(call_piece(0, '{"city": ')), chunk(call_piece(0, '"Oslo"}')),
    chunk(call_start(1, "call_b", "get_time")), chunk(call_piece(1, "{}")),
    chunk({}, "tool_calls"),
    chunk(usage=USAGE),
]


def chat_response(content: str | None, reasoning: str | None = None, tool_calls: list | None = None,
                  finish: str = "stop", **choice) -> dict:
    message = {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": tool_calls}
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": CREATED, "model": "fake-model",
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish, **choice}],
            "usage": USAGE}


def tool_call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class _Chunks:
    def __init__(self, chunks: list[dict], fail_after: int | None) -> None:
        self._chunks, self._fail_after, self._sent = list(chunks), fail_after, 0
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        if self._fail_after is not None and self._sent == self._fail_after:
            raise EngineError("the engine failed this request")
        if self._sent == len(self._chunks):
            raise StopAsyncIteration
        self._sent += 1
        return self._chunks[self._sent - 1]

    async def aclose(self) -> None:
        self.closed = True


class CannedChat:
    """``chat`` answers ``response``; ``open_chat_stream`` answers ``chunks`` (raising an engine error after
    ``fail_after`` chunks when set)."""

    def __init__(self, response: dict | None = None, chunks: list[dict] | None = None,
                 fail_after: int | None = None) -> None:
        self.response, self.chunks, self.fail_after = response, chunks or [], fail_after
        self.bodies: list[dict] = []
        self.streams: list[_Chunks] = []

    async def chat(self, body: dict, tenant=None) -> dict:
        self.bodies.append(body)
        return self.response

    async def open_chat_stream(self, body: dict, tenant=None) -> _Chunks:
        self.bodies.append(body)
        self.streams.append(_Chunks(self.chunks, self.fail_after))
        return self.streams[-1]
