"""LoRARequest: the adapter one request runs with (the engine's argument, the public API's type)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """Adapter ``name`` (unique within an engine: one name, one folder) from the PEFT folder ``path``, which
    every TP rank must be able to read."""

    name: str
    path: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or ":" in self.name:
            raise ValueError(f"lora_request: name must be a non-empty string without ':', got {self.name!r}")
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"lora_request: path must be a non-empty string, got {self.path!r}")

    @property
    def cache_namespace(self) -> int:
        """A 63-bit identity of (name, path), the same in every process: the prefix cache's chains of this
        adapter start from it (``block_manager.namespace_root``)."""
        digest = hashlib.sha256(f"{self.name}\0{self.path}".encode()).digest()
        return int.from_bytes(digest[:8], "big") >> 1
