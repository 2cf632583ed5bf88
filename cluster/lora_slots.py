"""LoRA on the engine side: which adapters a request may name (``LoraRegistry``), which adapters the ranks
hold read in host memory and which holds each of their ``max_loras`` slots (``AdapterSlots``).

- An adapter is its (name, path): the same name from another folder is another adapter (its own reads, slot
  and prefix chains). Whoever hands out names keeps one folder per name (``LLM``, the ingress' table).
- The registry checks an adapter once per (name, path) against the model from its config and file header
  (``workers/lora/adapter.read_adapter_config``: rank, targets, shapes), so a bad adapter is a ValueError
  naming it at intake and nothing else changes.
- Host memory: an admitted request whose adapter the ranks do not hold orders a read (``want``; the next plan
  carries it as ``lora_reads``). The ranks read on a thread of their own while steps go on; the request
  waits until rank 0 reports the read finished (``read_done``), and one that failed ends the requests
  waiting for that adapter with its error. At most ``max_cpu_loras`` adapters are held; a new read first
  drops the least recently wanted finished one that no sequence wanted in the current admission pass.
- Slots: a sequence that is admitted (first time, after a preemption, or forked) takes a reference on its
  adapter's slot; it gives it back when it leaves the running set (finished, preempted, aborted). An adapter
  not resident takes a free slot (one never used first, then the one whose last reference went longest
  ago) and the next plan carries the copy from host memory (``wire.LoraLoad``, cheap); with every slot
  referenced the sequence waits, and the scheduler admits the sequences queued after it meanwhile (their
  adapter resident, or none). A slot's adapter stays loaded after its last reference, so the next request
  with it loads nothing.
"""

from __future__ import annotations

from collections import OrderedDict

from pagedray.workers.contract.lora_request import LoRARequest
from pagedray.workers.contract.wire import LoraFiles, LoraLoad, LoraRead
from pagedray.workers.lora.adapter import AdapterConfig, ModuleShapes, read_adapter_config


class LoraRegistry:
    def __init__(self, shapes: ModuleShapes, max_rank: int, modules: dict[str, str]) -> None:
        self.shapes, self.max_rank = shapes, max_rank
        self._checked: dict[LoRARequest, AdapterConfig] = {}
        for name, path in modules.items():       # the configured adapters are checked at start-up
            self.check(LoRARequest(name, path))

    def check(self, lora: LoRARequest, again: bool = False) -> AdapterConfig:
        """The adapter's checked config (read once per (name, path); ``again``: read its files anew); a
        LoRAError (a ValueError) naming it when it cannot be served."""
        config = None if again else self._checked.get(lora)
        if config is None:
            config = read_adapter_config(lora.name, lora.path, self.shapes, self.max_rank)
            self._checked[lora] = config
        return config


class AdapterSlots:
    def __init__(self, max_loras: int, max_host: int | None = None) -> None:
        self.held: list[LoRARequest | None] = [None] * max_loras     # the adapter in each slot
        self.refs = [0] * max_loras
        self._slot_of: dict[LoRARequest, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict((slot, None) for slot in range(max_loras))   # refs == 0
        self._loads: list[LoraLoad] = []
        self.max_host = max_host or max_loras
        self._host: OrderedDict[LoRARequest, bool] = OrderedDict()   # read (True) or being read; LRU first
        self._wanted_now: set[LoRARequest] = set()     # wanted in the current admission pass: never dropped
        self._reads: list[LoraFiles] = []
        self._drops: list[LoraFiles] = []

    @property
    def names(self) -> list[str | None]:
        """The name of the adapter in each slot (None: empty)."""
        return [None if lora is None else lora.name for lora in self.held]

    @property
    def reads_in_flight(self) -> bool:
        return not all(self._host.values())

    # -- host memory ---------------------------------------------------------------------------------------
    def begin_pass(self) -> None:
        self._wanted_now.clear()

    def want(self, lora: LoRARequest) -> None:
        """``lora`` is wanted soon: order its read unless the ranks hold it (or are reading it). With
        ``max_host`` adapters held and none of them droppable (all being read, or wanted in this pass), the
        read waits for a later call."""
        self._wanted_now.add(lora)
        if lora in self._host:
            self._host.move_to_end(lora)
            return
        if len(self._host) >= self.max_host:
            victim = next((held for held, read in self._host.items() if read and held not in self._wanted_now), None)
            if victim is None:
                return
            del self._host[victim]
            self._drops.append(LoraFiles(victim.name, victim.path))
        self._host[lora] = False
        self._reads.append(LoraFiles(lora.name, lora.path))

    def read_done(self, read: LoraRead) -> str | None:
        """Rank 0 finished a read: the adapter is ready for a slot, or (returned) the error of a failed read,
        after which it is not held (a later request orders it again). A read no longer held is ignored."""
        lora = LoRARequest(read.name, read.path)
        if lora not in self._host:
            return None
        if read.error is not None:
            del self._host[lora]
            return read.error
        self._host[lora] = True
        return None

    def take_orders(self) -> tuple[list[LoraFiles], list[LoraFiles]]:
        """The reads and drops the next plan must carry (each once)."""
        orders = (self._reads, self._drops)
        self._reads, self._drops = [], []
        return orders

    # -- slots -----------------------------------------------------------------------------------------------
    def can_acquire(self, lora: LoRARequest) -> bool:
        """Whether ``acquire(lora)`` would give a slot (it is resident, or it is read and a slot is idle)."""
        return lora in self._slot_of or (self._host.get(lora, False) and bool(self._idle))

    def acquire(self, lora: LoRARequest) -> int | None:
        """A reference on ``lora``'s slot (loading it into a free one if needed), or None: it is not read yet,
        or every slot is in use."""
        slot = self._slot_of.get(lora)
        if slot is None:
            if not self._idle or not self._host.get(lora, False):
                return None
            self._host.move_to_end(lora)
            never_used = next((s for s in self._idle if self.held[s] is None), None)
            slot = never_used if never_used is not None else next(iter(self._idle))
            if self.held[slot] is not None:
                del self._slot_of[self.held[slot]]
            self.held[slot] = lora
            self._slot_of[lora] = slot
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
        """The ranks lost their slots and host copies (a rebuilt TP group): every adapter is read and loaded
        again when next used. Only with no reference held (the scheduler re-queues every sequence first)."""
        if any(self.refs):
            raise RuntimeError("lora slots: forgetting the resident adapters while sequences use them")
        self.held = [None] * len(self.held)
        self._slot_of.clear()
        self._idle = OrderedDict((slot, None) for slot in range(len(self.held)))
        self._loads = []
        self._host.clear()
        self._reads, self._drops = [], []
