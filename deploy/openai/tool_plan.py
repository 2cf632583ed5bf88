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

    def parameter_types(self, name: str, key: str) -> tuple[str, ...]:
        """The JSON types that function ``name``'s schema declares for its parameter ``key``: the property's
        ``type`` (a string or a list of them) or, without one, the ``type``s of its ``anyOf`` / ``oneOf``
        alternatives (``Optional[int]`` is ``anyOf: [{type: integer}, {type: null}]``); () when it declares
        none (no schema, no such property). For formats whose arguments are text (qwen3_xml)."""
        properties = self.parameters(name).get("properties")
        spec = properties.get(key) if isinstance(properties, dict) else None
        if not isinstance(spec, dict):
            return ()
        alternatives = [spec] if "type" in spec else spec.get("anyOf") or spec.get("oneOf") or []
        types: list[str] = []
        for alternative in alternatives if isinstance(alternatives, list) else []:
            kind = alternative.get("type") if isinstance(alternative, dict) else None
            kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
            types += [t for t in kinds if isinstance(t, str)]
        return tuple(types)
