"""Several models behind one API (#66): the served models' OpenAIServices, and which one a request is for.

A request names its model in the body's ``model`` (a served name, an alias, a LoRA adapter of a model, or
``<model>:<adapter>``): the service serving that name takes it. A body without ``model`` (or a handle call
without one) goes to the first model, as with one model. A name no model serves is a 404 that lists every served
name. ``GET /v1/models`` lists every model (and their adapters), /metrics every model's series (labelled by
``model_name``), and /health is healthy when every model is.

Invariant: served names and aliases are unique across the table (``ServiceTable`` refuses a clash, naming it).
"""

from __future__ import annotations

from .errors import APIError
from .validation import serves


class ServiceTable:
    def __init__(self, services: list) -> None:
        if not services:
            raise ValueError("services: at least one model is needed")
        seen: dict[str, int] = {}            # name -> the index of the model it names
        for index, service in enumerate(services if len(services) > 1 else ()):   # one model: nothing to clash
            for name in service.limits.aliases:
                if seen.setdefault(name, index) != index:
                    raise ValueError(f"served_model_name: {name!r} would name two models (models {seen[name]} "
                                     f"and {index})")
        self.services = list(services)

    @property
    def first(self):
        return self.services[0]

    def for_model(self, name) -> object:
        """The service serving ``name`` (None or not a string: the first model); 404 naming it otherwise."""
        if name is None or not isinstance(name, str) or len(self.services) == 1:
            return self.first     # one model: its own check_model answers, as before
        for service in self.services:
            if serves(name, service.limits):
                return service
        available = ", ".join(repr(n) for s in self.services
                              for n in [s.limits.served_name, *s.limits.lora_adapters.names()])
        raise APIError(404, f"model: {name!r} is not served here; available: {available}", "not_found_error",
                       param="model", code="model_not_found")

    def for_body(self, body) -> object:
        """The service for a decoded request body (its ``model``; a body that is not an object: the first, whose
        parsing then answers the 400)."""
        return self.for_model(body.get("model") if isinstance(body, dict) else None)

    def models(self) -> dict:
        """GET /v1/models: every model's cards, in table order."""
        return {"object": "list", "data": [card for s in self.services for card in s.models()["data"]]}

    async def check_ready(self) -> None:
        for service in self.services:
            await service.check_ready()

    async def metrics_text(self) -> bytes:
        """Every model's series: the services share one registry when built together (``ServerMetrics``'s
        ``families``), so the first renders them all once the others have refreshed their engine gauges."""
        for service in self.services[1:]:
            await service.refresh_engine_metrics()
        return await self.first.metrics_text()
