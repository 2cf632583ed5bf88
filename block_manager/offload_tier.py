"""OffloadTier: the keys of cached blocks that left the pool for the ranks' second KV tier, and their slots.

When ``BlockPool.allocate`` hands out a free block that still holds a prefix-cache key, the block's bytes would
be lost; with a tier, ``save`` gives the key a tier slot and the next plan tells every rank to copy the block
there first (``StepPlan.kv_saves``; ``workers/kv_tier.py``). A later prompt that reaches the key again
(``BlockManager.tier_prefix``) has it loaded back into a free block (``StepPlan.kv_loads``) before it is
admitted; a load that fails on any rank leaves the block uncached, and the prompt computes it again.

Rules:
- An LRU over ``num_slots`` slots: a save into a full tier drops the least recently saved or looked-up key.
- ``take(key)`` removes a key whose slot a plan is about to read; that slot is held back until the plan is
  built (``release_held``), so no save of the same plan can overwrite it (ranks run the saves first).
"""

from __future__ import annotations

from collections import OrderedDict

from .prefix_key import BlockKey


class OffloadTier:
    def __init__(self, num_slots: int) -> None:
        if type(num_slots) is not int or num_slots < 1:  # noqa: E721
            raise ValueError(f"num_slots: must be an integer >= 1, got {num_slots!r}")
        self.num_slots = num_slots
        self._slot_of: OrderedDict[BlockKey, int] = OrderedDict()     # least recently used first
        self._free = list(range(num_slots - 1, -1, -1))                 # a stack: slot 0 first
        self._held: list[int] = []
        self.num_saved = 0
        self.num_dropped = 0          # keys dropped to make room

    def __len__(self) -> int:
        return len(self._slot_of)

    def save(self, key: BlockKey) -> int:
        """The slot ``key``'s block is saved into (its own again when it is already in the tier)."""
        self.num_saved += 1
        slot = self._slot_of.get(key)
        if slot is not None:
            self._slot_of.move_to_end(key)
            return slot
        if self._free:
            slot = self._free.pop()
        else:
            _, slot = self._slot_of.popitem(last=False)
            self.num_dropped += 1
        self._slot_of[key] = slot
        return slot

    def key_hashes(self, limit: int) -> list[int]:
        """Hashes of at most ``limit`` keys in the tier, the most recently used first (routing summaries)."""
        out = []
        for key in reversed(self._slot_of):
            if len(out) >= limit:
                break
            out.append(hash(key))
        return out

    def lookup(self, key: BlockKey) -> int | None:
        slot = self._slot_of.get(key)
        if slot is not None:
            self._slot_of.move_to_end(key)
        return slot

    def take(self, key: BlockKey) -> int:
        """Removes ``key`` (its slot is read by the plan being built: held back until ``release_held``)."""
        slot = self._slot_of.pop(key)
        self._held.append(slot)
        return slot

    def release_held(self) -> None:
        self._free.extend(self._held)
        self._held = []

    def check_invariants(self) -> None:
        slots = list(self._slot_of.values()) + self._free + self._held
        assert sorted(slots) == list(range(self.num_slots)), f"tier slots lost or doubled: {sorted(slots)}"
