"""StatePool: the second pool a hybrid model needs beside the paged KV blocks: one state slot per running
sequence (the recurrent and convolution state of its linear-attention layers, which the workers keep at that
slot: workers/layers/gated_delta_net.py), and the prefix cache's state snapshots. The block manager owns it next
to the block pool, so a sequence's blocks and its slot are taken, forked and given back together.

Slots ``[0, num_slots)`` are seats: each held by one registered sequence. Slots ``[num_slots, num_slots +
num_snapshots)`` are snapshots: the state a sequence reached at the end of a cached full block, kept under that
block's chained key (``prefix_key.BlockKey``), so that a later prompt with the same prefix starts its seat from a
copy of it instead of from zeros (cluster/hybrid.py).

- A snapshot is reserved (``reserve_snapshot``) while a step is planned; the workers write it during that step's
  forward. It stays pending, invisible to lookups, until ``commit_snapshots`` (the next plan): a prompt admitted
  into the same step copies its state before that forward, when the snapshot is not written yet.
- Committed snapshots are evicted least recently used first (a hit refreshes one); a pending one is never
  evicted, so a slot is written at most once per step. A decoding sequence keeps one trailing snapshot at its last
  block end (the block manager's ``trail_state_snapshot``): the next one gives the previous back. A snapshot
  whose KV blocks were evicted is never used (a hit needs the blocks too) and goes with the LRU.

Invariants (``check_invariants``): every seat is free xor held by exactly one sequence; a sequence holds at
most one seat; ``num_free + len(held) == num_slots``; every snapshot slot is free xor committed xor pending,
under one key. A freed seat is handed out again lowest first (ids stay small and the workers' pool dense); its
old content is never read (a sequence whose first step starts at position 0 starts from zeros, on the workers,
and one that starts later has a snapshot copied in first).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable


class StatePool:
    def __init__(self, num_slots: int, num_snapshots: int = 0) -> None:
        if type(num_slots) is not int or num_slots < 0:  # noqa: E721
            raise ValueError(f"num_state_slots: must be an integer >= 0, got {num_slots!r}")
        if type(num_snapshots) is not int or num_snapshots < 0:  # noqa: E721
            raise ValueError(f"num_state_snapshots: must be an integer >= 0, got {num_snapshots!r}")
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots
        self._free = list(range(num_slots))          # a heap
        self._held: dict[Hashable, int] = {}
        self._free_snapshots = list(range(num_slots + num_snapshots - 1, num_slots - 1, -1))   # popped lowest first
        self._snapshots: OrderedDict[Hashable, int] = OrderedDict()    # committed: key -> slot, oldest use first
        self._pending: dict[Hashable, int] = {}                       # reserved for the step being planned

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

    # -- snapshots for the prefix cache ------------------------------------------------------------
    def snapshot_of(self, key: Hashable) -> int | None:
        """The committed snapshot under ``key`` (refreshed as the most recently used), else None."""
        slot = self._snapshots.get(key)
        if slot is not None:
            self._snapshots.move_to_end(key)
        return slot

    def has_snapshot(self, key: Hashable) -> bool:
        return key in self._snapshots

    def reserve_snapshot(self, key: Hashable) -> int | None:
        """A slot for the snapshot under ``key``, pending until ``commit_snapshots``: a free one, else the least
        recently used committed one's. None when ``key`` has one already (committed or pending) or every snapshot
        slot is pending."""
        if key in self._snapshots or key in self._pending:
            return None
        if self._free_snapshots:
            slot = self._free_snapshots.pop()
        elif self._snapshots:
            _, slot = self._snapshots.popitem(last=False)
        else:
            return None
        self._pending[key] = slot
        return slot

    def release_snapshot(self, key: Hashable) -> None:
        """Gives the committed snapshot under ``key`` back (nothing when it was evicted already)."""
        slot = self._snapshots.pop(key, None)
        if slot is not None:
            self._free_snapshots.append(slot)

    def commit_snapshots(self) -> None:
        """The pending snapshots were written (their plan ran before any later one): lookups find them now."""
        for key, slot in self._pending.items():
            self._snapshots[key] = slot
        self._pending.clear()

    def check_invariants(self, seq_ids) -> None:
        """``seq_ids``: the sequences the block manager holds; each holds one slot here."""
        held = sorted(self._held.values())
        assert len(set(held)) == len(held), f"state pool: a slot is held twice: {held}"
        assert not set(held) & set(self._free), "state pool: a slot is both free and held"
        assert len(held) + len(self._free) == self.num_slots, (
            f"state pool: {len(held)} held + {len(self._free)} free != {self.num_slots} slots")
        assert set(self._held) == set(seq_ids), "state pool: the sequences holding slots are not the registered ones"
        snapshots = list(self._snapshots.values()) + list(self._pending.values()) + self._free_snapshots
        assert sorted(snapshots) == list(range(self.num_slots, self.num_slots + self.num_snapshots)), (
            f"state pool: snapshot slots are not each free xor committed xor pending: {sorted(snapshots)}")
        assert not set(self._snapshots) & set(self._pending), "state pool: a key is both committed and pending"
