"""StatePool: the second pool a hybrid model needs beside the paged KV blocks: one state slot per running
sequence (the recurrent and convolution state of its linear-attention layers, which the workers keep at that
slot: workers/layers/gated_delta_net.py). The block manager owns it next to the block pool, so a sequence's
blocks and its slot are taken, forked and given back together.

Invariants (``check_invariants``): every slot is free xor held by exactly one sequence; a sequence holds at
most one slot; ``num_free + len(held) == num_slots``. A freed slot is handed out again lowest first (ids
stay small and the workers' pool dense); its old content is never read (a sequence whose first step starts
at position 0 starts from zeros, on the workers).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable


class StatePool:
    def __init__(self, num_slots: int) -> None:
        if type(num_slots) is not int or num_slots < 0:  # noqa: E721
            raise ValueError(f"num_state_slots: must be an integer >= 0, got {num_slots!r}")
        self.num_slots = num_slots
        self._free = list(range(num_slots))          # a heap
        self._held: dict[Hashable, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot_of(self, seq_id: Hashable) -> int:
        """The sequence's slot, or -1 when it holds none."""
        return self._held.get(seq_id, -1)

    def acquire(self, seq_id: Hashable) -> int:
        """A slot for ``seq_id`` (which holds none yet); RuntimeError when every slot is held: the scheduler
        never runs more sequences than there are slots (``max_num_seqs``), so this is a bug, not back-pressure."""
        if seq_id in self._held:
            raise RuntimeError(f"state pool: sequence {seq_id!r} already holds slot {self._held[seq_id]}")
        if not self._free:
            raise RuntimeError(f"state pool: all {self.num_slots} state slots are held (sequence {seq_id!r})")
        slot = self._held[seq_id] = heapq.heappop(self._free)
        return slot

    def release(self, seq_id: Hashable) -> None:
        slot = self._held.pop(seq_id, None)
        if slot is not None:
            heapq.heappush(self._free, slot)

    def check_invariants(self, seq_ids) -> None:
        """``seq_ids``: the sequences the block manager holds; each holds one slot here."""
        held = sorted(self._held.values())
        assert len(set(held)) == len(held), f"state pool: a slot is held twice: {held}"
        assert not set(held) & set(self._free), "state pool: a slot is both free and held"
        assert len(held) + len(self._free) == self.num_slots, (
            f"state pool: {len(held)} held + {len(self._free)} free != {self.num_slots} slots")
        assert set(self._held) == set(seq_ids), "state pool: the sequences holding slots are not the registered ones"
