"""LoRA on the engine side: which adapters a request may name (``LoraRegistry``), and which adapter holds
each of the ranks' ``max_loras`` slots (``AdapterSlots``).

- The registry checks an adapter once per (name, path) against the model from its config and file header
  (``workers/lora/adapter.read_adapter_config``: rank, targets, shapes) and keeps one folder per name, so a
  bad adapter is a ValueError naming it at intake and nothing else changes.
- Slots: a sequence that is admitted (first time, after a preemption, or forked) takes a reference on its
  adapter's slot; it gives it back when it leaves the running set (finished, preempted, aborted). An adapter
  not resident takes a free slot (one never used first, then the one whose last reference went longest
  ago) and the next plan carries the load (``wire.LoraLoad``); with every slot referenced the sequence
  waits, and the scheduler admits the sequences queued after it meanwhile (their adapter resident, or none).
  A slot's adapter stays loaded after its last reference, so the next request with it loads nothing.
"""

from __future__ import annotations

from collections import OrderedDict

from pagedray.workers.contract.lora_request import LoRARequest
from pagedray.workers.contract.wire import LoraLoad
from pagedray.workers.lora.adapter import AdapterConfig, ModuleShapes, read_adapter_config


class LoraRegistry:
    def __init__(self, shapes: ModuleShapes, max_rank: int, modules: dict[str, str]) -> None:
        self.shapes, self.max_rank = shapes, max_rank
        self._paths: dict[str, str] = {}
        self._checked: dict[tuple[str, str], AdapterConfig] = {}
        for name, path in modules.items():       # the configured adapters are checked at start-up
            self.check(LoRARequest(name, path))

    @property
    def names(self) -> dict[str, str]:
        """Every adapter checked so far: name -> folder."""
        return dict(self._paths)

    def check(self, lora: LoRARequest) -> AdapterConfig:
        """The adapter's checked config; LoRAError / ValueError naming it (nothing registered) when it cannot
        be served, or when its name is taken by another folder."""
        known = self._paths.get(lora.name)
        if known is not None and known != lora.path:
            raise ValueError(f"lora_request: adapter {lora.name!r} is already served from {known}, not {lora.path}")
        config = self._checked.get((lora.name, lora.path))
        if config is None:
            config = read_adapter_config(lora.name, lora.path, self.shapes, self.max_rank)
            self._checked[(lora.name, lora.path)] = config
            self._paths[lora.name] = lora.path
        return config

    def resolve(self, name: str) -> LoRARequest | None:
        """The registered adapter called ``name``, or None."""
        path = self._paths.get(name)
        return None if path is None else LoRARequest(name, path)


class AdapterSlots:
    def __init__(self, max_loras: int) -> None:
        self.names: list[str | None] = [None] * max_loras
        self.refs = [0] * max_loras
        self._slot_of: dict[str, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict((slot, None) for slot in range(max_loras))   # refs == 0
        self._loads: list[LoraLoad] = []

    def can_acquire(self, lora: LoRARequest) -> bool:
        """Whether ``acquire(lora)`` would give a slot (it is resident, or a slot is idle)."""
        return lora.name in self._slot_of or bool(self._idle)

    def acquire(self, lora: LoRARequest) -> int | None:
        """A reference on ``lora``'s slot (loading it into a free one if needed), or None: every slot is in use."""
        slot = self._slot_of.get(lora.name)
        if slot is None:
            if not self._idle:
                return None
            never_used = next((s for s in self._idle if self.names[s] is None), None)
            slot = never_used if never_used is not None else next(iter(self._idle))
            if self.names[slot] is not None:
                del self._slot_of[self.names[slot]]
            self.names[slot] = lora.name
            self._slot_of[lora.name] = slot
            self._loads = [load for load in self._loads if load.slot != slot] + [LoraLoad(slot, lora.name, lora.path)]
        self.refs[slot] += 1
        self._idle.pop(slot, None)
        return slot

    def release(self, slot: int) -> None:
        if self.refs[slot] <= 0:
            raise RuntimeError(f"lora slot {slot} released more often than acquired")
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            self._idle[slot] = None

    def take_loads(self) -> list[LoraLoad]:
        """The loads the next plan must carry (each once)."""
        loads, self._loads = self._loads, []
        return loads

    def forget_resident(self) -> None:
        """The ranks lost their slots (a rebuilt TP group): every adapter loads again when next used. Only
        with no reference held (the scheduler re-queues every sequence first)."""
        if any(self.refs):
            raise RuntimeError("lora slots: forgetting the resident adapters while sequences use them")
        self.names = [None] * len(self.names)
        self._slot_of.clear()
        self._idle = OrderedDict((slot, None) for slot in range(len(self.names)))
        self._loads = []
