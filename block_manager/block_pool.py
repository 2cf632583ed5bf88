"""BlockPool: a fixed set of KV blocks with ref counts, a free queue and the prefix-cache map.

Block ids are ``0 .. num_blocks - 1`` and are global (the same id on every tensor-parallel rank).

Invariants (checked by ``check_invariants``):
- a block is free (ref count 0, in the free queue exactly once) xor referenced (ref count > 0, not
  in the queue);
- ``num_free_blocks == len(free queue)``;
- the cache map and the per-block keys agree: ``cached[key] == b`` exactly when ``key_of(b) is key``;
  a block with a key is either referenced or free-but-findable (a "cached free" block);
- a free block keeps its key until ``allocate`` hands it out again: only then is the key evicted;
- pins (session pins, ``session_pins.py``): a free block with a pin count > 0 waits in the pinned free queue,
  every other free block in the free queue; ``allocate`` takes from the free queue first, so pinned blocks
  are evicted last. A pinned block handed out anyway loses its pins (``num_pin_evictions``).

Decisions: docs/design/block_manager.md, ``pagedray.block_manager.block_pool``.
"""

from __future__ import annotations

from .errors import CannotAllocateError, DoubleFreeError
from .free_queue import FreeBlockQueue
from .prefix_key import BlockKey


class BlockPool:
    """Ref-counted blocks, a free queue in eviction order and the key -> block map of cached blocks."""

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"num_blocks: must be an integer >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._keys: list[BlockKey | None] = [None] * num_blocks
        self._free = FreeBlockQueue(num_blocks)
        self._free_pinned = FreeBlockQueue(num_blocks, empty=True)   # free blocks with pins: evicted last
        self._pins = [0] * num_blocks
        self._cached: dict[BlockKey, int] = {}
        self.num_evictions = 0
        self.num_pin_evictions = 0
        self.on_evict = None     # (block_id, key) -> None, called before a handed-out block loses its key

    # -- counts -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._free_pinned)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one sequence (0..1)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        self._check_block_id(block_id)
        return self._ref_counts[block_id]

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order (head first): the unpinned ones, then the pinned ones."""
        return list(self._free) + list(self._free_pinned)

    def pin_count(self, block_id: int) -> int:
        return self._pins[block_id]

    # -- allocate / touch / free --------------------------------------------------------------
    def allocate(self, count: int) -> list[int]:
        """Hand out ``count`` blocks from the head of the free queue, each with ref count 1.

        A handed-out block that still held a cached key loses it (eviction). Raises
        CannotAllocateError and changes nothing when fewer than ``count`` blocks are free.
        """
        free = self._free
        if count > len(free) + len(self._free_pinned):
            raise CannotAllocateError(count, self.num_free_blocks)
        ref_counts = self._ref_counts
        keys = self._keys
        blocks = []
        for _ in range(count):
            if len(free):
                block_id = free.popleft()
            else:                                   # only pinned blocks are left: the oldest pinned goes
                block_id = self._free_pinned.popleft()
                self._pins[block_id] = 0
                self.num_pin_evictions += 1
            key = keys[block_id]
            if key is not None:
                if self.on_evict is not None:
                    self.on_evict(block_id, key)
                del self._cached[key]
                keys[block_id] = None
                self.num_evictions += 1
            ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def touch(self, block_id: int) -> None:
        """Add one reference; a free (cached) block leaves the free queue in O(1)."""
        ref = self._ref_counts[block_id]
        if ref == 0:
            (self._free_pinned if self._pins[block_id] else self._free).remove(block_id)
        self._ref_counts[block_id] = ref + 1

    def release(self, block_id: int) -> None:
        """Drop one reference; at 0 the block goes to the tail of the free queue, keeping its key."""
        ref = self._ref_counts[block_id]
        if ref == 0:
            raise DoubleFreeError(f"block {block_id} released while its ref count is already 0")
        self._ref_counts[block_id] = ref - 1
        if ref == 1:
            (self._free_pinned if self._pins[block_id] else self._free).append(block_id)

    def pin(self, block_id: int) -> None:
        """One more pin on ``block_id`` (a free one moves to the pinned free queue's tail)."""
        pins = self._pins[block_id]
        if pins == 0 and self._ref_counts[block_id] == 0:
            self._free.remove(block_id)
            self._free_pinned.append(block_id)
        self._pins[block_id] = pins + 1

    def unpin(self, block_id: int) -> None:
        """One pin less (at 0 a free block moves to the free queue's tail). A block without pins is left as
        it is: its pins went when it was handed out again (``allocate``)."""
        pins = self._pins[block_id]
        if pins == 0:
            return
        self._pins[block_id] = pins - 1
        if pins == 1 and self._ref_counts[block_id] == 0:
            self._free_pinned.remove(block_id)
            self._free.append(block_id)

    # -- prefix cache ---------------------------------------------------------------------------
    def lookup(self, key: BlockKey) -> int | None:
        """The block cached under ``key`` (referenced or free-but-not-yet-evicted), else None."""
        return self._cached.get(key)

    def key_of(self, block_id: int) -> BlockKey | None:
        return self._keys[block_id]

    def cache(self, block_id: int, key: BlockKey) -> BlockKey:
        """Register a referenced, full block under ``key``; return the canonical key object.

        If ``key`` is already cached by another block, ``block_id`` stays without a key and the
        cached key object is returned (callers chain their next key onto it).
        """
        existing = self._cached.get(key)
        if existing is not None:
            return self._keys[existing]  # type: ignore[return-value]
        self._cached[key] = block_id
        self._keys[block_id] = key
        return key

    def cached_keys(self) -> set[BlockKey]:
        return set(self._cached)

    def cached_key_hashes(self, limit: int) -> list[int]:
        """Hashes of at most ``limit`` cached keys: those of referenced blocks first, then the free
        ones from the most recently freed (the last to be evicted)."""
        referenced = [hash(k) for k, b in self._cached.items() if self._ref_counts[b] > 0]
        if len(referenced) >= limit:
            return referenced[:limit]
        free_cached = [b for b in reversed(self.free_block_ids()) if self._keys[b] is not None]
        return referenced + [hash(self._keys[b]) for b in free_cached[:limit - len(referenced)]]

    # -- checks -----------------------------------------------------------------------------------
    def _check_block_id(self, block_id: int) -> None:
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block_id: must be an integer in [0, {self.num_blocks}), got {block_id!r}")

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first violated invariant (see the module docstring)."""
        queued = list(self._free) + list(self._free_pinned)
        queued_set = set(queued)
        assert len(queued) == len(queued_set), f"free queues hold a block twice: {queued}"
        assert len(queued) == self.num_free_blocks, (
            f"free queue lengths {self.num_free_blocks} != {len(queued)} linked blocks")
        for block_id in self._free_pinned:
            assert self._pins[block_id] > 0, f"block {block_id} waits in the pinned free queue without a pin"
        for block_id in self._free:
            assert self._pins[block_id] == 0, f"block {block_id} has pins but waits in the unpinned free queue"
        for block_id, ref in enumerate(self._ref_counts):
            assert ref >= 0, f"block {block_id} has negative ref count {ref}"
            assert (ref == 0) == (block_id in queued_set), (
                f"block {block_id}: ref count {ref} but {'in' if block_id in queued_set else 'not in'}"
                " the free queue (must be free xor referenced)")
        for key, block_id in self._cached.items():
            assert self._keys[block_id] is key, f"cache maps a key to block {block_id}, which holds another key"
        num_keyed = sum(key is not None for key in self._keys)
        assert num_keyed == len(self._cached), (
            f"{num_keyed} blocks hold keys but the cache maps {len(self._cached)}")
