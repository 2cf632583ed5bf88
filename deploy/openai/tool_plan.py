"""ToolPlan: what a request's ``tools`` / ``tool_choice`` resolved to (tools.py builds it; the stream parsers in
tool_parsers.py and the service read it). Its own module so that tools.py and tool_parsers.py both import it
and neither imports the other back.

Decisions: docs/design/deploy.md, ``pagedray.deploy.openai.tools``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[dict, ...]        # the "function" objects (name, description, parameters), in request order
    choice: str                    # "auto" | "required" | "named"
    name: str | None = None        # the function of a named choice
    parallel: bool = True
    parser: str = "hermes"         # the model's tool-call format (tool_parsers.py), set by the service

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["name"] for t in self.tools)

    def parameters(self, name: str) -> dict:
        return next(t.get("parameters") or {"type": "object"} for t in self.tools if t["name"] == name)
