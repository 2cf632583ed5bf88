"""Feeding a tool-call parser piece by piece, with every delta checked to be a well-formed OpenAI chat delta."""

from __future__ import annotations

import re

from pagedray.deploy.openai.tool_parsers import ToolCallStream

CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def checked_stream(pieces, plan, parser: str):
    """(every delta of the pieces fed one by one, the stream): a header has the next index, an id, the type,
    a known name and no arguments; an arguments piece belongs to the last call and is not empty."""
    s = ToolCallStream(plan, parser)
    deltas = [d for piece in pieces for d in s.feed(piece)] + s.finish()
    seen = 0
    for delta in deltas:
        assert len(delta) == 1 and (delta.get("content") or delta.get("tool_calls"))
        for entry in delta.get("tool_calls", ()):
            if "id" in entry:   # a header: the next index, the name, no arguments yet
                assert entry["index"] == seen and CALL_ID.fullmatch(entry["id"]) and entry["type"] == "function"
                assert entry["function"]["name"] in plan.names and entry["function"]["arguments"] == ""
                seen += 1
            else:
                assert set(entry) == {"index", "function"} and entry["index"] == seen - 1
                assert entry["function"]["arguments"]
    assert s.made_calls == (seen > 0) or not plan.parallel
    return deltas, s
