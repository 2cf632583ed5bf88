"""Server-sent events framing for OpenAI streaming responses.

Each event is one line ``data: <compact JSON>`` followed by a blank line; the stream ends with
``data: [DONE]``. An error after the stream has started (the HTTP status is already 200) is sent as
one ``data: {"error": {...}}`` event followed by ``[DONE]``, as the OpenAI API does.
"""

from __future__ import annotations

import json

from pydantic import BaseModel

SSE_MEDIA_TYPE = "text/event-stream"
SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(payload: BaseModel | dict) -> str:
    data = payload.model_dump() if isinstance(payload, BaseModel) else payload
    return "data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False) + "\n\n"


def parse_sse(text: str) -> list[dict | str]:
    """Inverse of the framing above (used by the CLI and tests): JSON payloads, or the string "[DONE]"."""
    events: list[dict | str] = []
    for block in text.split("\n\n"):
        block = block.strip()
        if not block.startswith("data: "):
            continue
        body = block[len("data: "):]
        events.append(body if body == "[DONE]" else json.loads(body))
    return events
