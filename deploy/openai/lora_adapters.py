"""The LoRA adapters the API serves by name, and loading / unloading them at run time (no Ray here).

``AdapterTable`` maps a name to its adapter (``LoRARequest``: name + folder). It starts with the configured
``lora_modules``; ``POST /v1/load_lora_adapter`` adds one and ``POST /v1/unload_lora_adapter`` removes one
(vLLM's routes and bodies), both behind the API key.

- Load: ``{"lora_name": ..., "lora_path": ...}``. The engine checks the adapter against the model from its
  files first (``EngineClient.check_lora``: rank, targets, shapes), so a bad one is a 400 naming it and the
  table does not change. A name already served is a 400 unless ``load_inplace`` is true, which serves the
  name from the new folder. The same folder again under ``load_inplace`` is refused: an adapter is its
  (name, folder), and the ranks keep the weights they read from a folder, so new weights need a new folder.
- Unload: ``{"lora_name": ...}``; 404 for a name not served. Requests already running with the adapter finish
  with it; new ones naming it get 404. The ranks drop its weights when their slots and host memory are
  wanted for other adapters (``cluster/lora_slots.py``).
- The table belongs to the ingress replica. With several ingress replicas (``engine_in_ingress`` with more
  than one replica) a load would reach one of them only, so run-time loading is refused there (a 400 that
  says to list the adapter in ``lora_modules``).
"""

from __future__ import annotations

from pagedray.workers.contract.lora_request import LoRARequest
from pydantic import BaseModel, ConfigDict

from .errors import APIError, bad_request


class AdapterTable:
    """name -> LoRARequest; one folder per name at a time."""

    def __init__(self, adapters=()) -> None:
        """``adapters``: (name, folder) pairs or LoRARequests (ValueError for a bad name or folder)."""
        self._by_name: dict[str, LoRARequest] = {}
        for item in adapters:
            lora = item if isinstance(item, LoRARequest) else LoRARequest(*item)
            self._by_name[lora.name] = lora

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def adapters(self) -> list[LoRARequest]:
        return list(self._by_name.values())

    def names(self) -> list[str]:
        return list(self._by_name)

    def put(self, lora: LoRARequest) -> None:
        self._by_name[lora.name] = lora

    def remove(self, name: str) -> LoRARequest | None:
        return self._by_name.pop(name, None)


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    lora_name: str


def adapter_to_load(req: LoadLoraAdapterRequest, table: AdapterTable, base_names: frozenset[str]) -> LoRARequest:
    """The adapter a load request names, after the checks that need no engine (APIError 400 naming the field)."""
    try:
        lora = LoRARequest(req.lora_name, req.lora_path)
    except ValueError as exc:
        field = "lora_path" if "path must be" in str(exc) else "lora_name"
        raise bad_request(f"{field}: {str(exc).removeprefix('lora_request: ')}", param=field) from None
    if lora.name in base_names:
        raise bad_request(f"lora_name: {lora.name!r} is the base model's name", param="lora_name")
    served = table.get(lora.name)
    if served is not None and not req.load_inplace:
        raise bad_request(f"lora_name: adapter {lora.name!r} is already loaded (from {served.path}); unload it "
                          "first or set load_inplace", param="lora_name", code="lora_adapter_exists")
    if served is not None and served.path == lora.path:
        raise bad_request(f"load_inplace: adapter {lora.name!r} is already served from {lora.path}; the ranks keep "
                          "the weights they read from a folder, so load new weights from a new folder",
                          param="load_inplace")
    return lora


def adapter_to_unload(req: UnloadLoraAdapterRequest, table: AdapterTable) -> str:
    if table.get(req.lora_name) is None:
        raise APIError(404, f"lora_name: adapter {req.lora_name!r} is not loaded; loaded: "
                       f"{', '.join(map(repr, table.names())) or 'none'}", "not_found_error", param="lora_name",
                       code="lora_adapter_not_found")
    return req.lora_name
