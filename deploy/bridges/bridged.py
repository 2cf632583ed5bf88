"""A Responses (responses_api.py) or Messages (messages_api.py) body run as a chat request, for both the
HTTP routes and the Python handle API (serve/ingress.py): translate, call the chat path, translate back.

``run_bridged`` returns the route's whole object, or (``call.stream``) an async iterator of its stream's
event dicts; a chat-path error (validation, 429, 503) is re-raised as the same APIError restated in the
route's own field names (``CHAT_NAMES``). A big body is translated off the event loop.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from types import ModuleType

from ..openai.errors import to_api_error
from ..openai.prepare_lanes import input_within, off_loop_if
from .chat_bridge import renamed

SMALL_BODY = 16_384   # entries + string characters translated on the event loop


class BridgedStream:
    """The events of a bridged stream; ``aclose`` closes them and the chat stream under them."""

    def __init__(self, events: AsyncIterator[dict], chunks) -> None:
        self._events, self._chunks = events, chunks

    def __aiter__(self) -> BridgedStream:
        return self

    async def __anext__(self) -> dict:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        await self._events.aclose()
        await self._chunks.aclose()   # also when the events never started


async def run_bridged(service, api: ModuleType, events_of: Callable, body, stream: bool | None = None,
                      tenant: str | None = None):
    """``api``: responses_api or messages_api; ``events_of(chunks, call)``: its stream translator.
    ``stream`` overrides the body's ``stream`` (the handle API's whole / streaming methods); ``tenant``: the
    caller's (``http/tenants.py``)."""
    if stream is not None and isinstance(body, dict):
        body = {**body, "stream": stream}
    call = await off_loop_if(not input_within(body, SMALL_BODY), functools.partial(api.to_chat, body))
    try:
        if call.stream:
            chunks = await service.open_chat_stream(call.chat_body, tenant)
        else:
            return api.from_chat(await service.chat(call.chat_body, tenant), call)
    except Exception as exc:
        raise renamed(to_api_error(exc), api.CHAT_NAMES) from exc
    return BridgedStream(events_of(chunks, call), chunks)
