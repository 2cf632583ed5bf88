"""The free block queue, kept in eviction order.

An intrusive doubly linked list over block ids, stored in two flat lists (``_next``/``_prev``) with
one sentinel slot at index ``num_blocks``. Every operation is O(1):

- ``popleft``: the head is the next block to hand out (and, if it still holds a cached key, the
  block whose key is evicted);
- ``append``: a freed block goes to the tail (evicted last);
- ``remove``: a cached block that is hit again leaves the middle of the queue.

Invariant: the list visits each queued block exactly once, head to tail, and ``len`` equals the
number of queued blocks. The queue does not know which blocks are queued; ``BlockPool`` guarantees
that only blocks with ref count 0 are in it (it checks that before calling ``append``/``remove``).
"""

from __future__ import annotations

from collections.abc import Iterator


class FreeBlockQueue:
    """Free block ids, head = evicted first."""

    __slots__ = ("_next", "_prev", "_sentinel", "_size")

    def __init__(self, num_blocks: int, empty: bool = False) -> None:
        """Start with every block queued in id order: 0 at the head, ``num_blocks - 1`` at the tail (``empty``:
        none queued; block ids up to ``num_blocks - 1`` may be appended)."""
        sentinel = num_blocks
        self._sentinel = sentinel
        # block i -> i + 1 (the last block -> the sentinel); the sentinel -> the head (block 0)
        self._next = list(range(1, num_blocks + 1)) + [0 if num_blocks else sentinel]
        # block i -> i - 1 (block 0 -> the sentinel); the sentinel -> the tail (the last block)
        self._prev = list(range(-1, num_blocks - 1)) + [num_blocks - 1 if num_blocks else sentinel]
        if num_blocks:
            self._prev[0] = sentinel
        self._size = num_blocks
        if empty:
            self._next[sentinel] = self._prev[sentinel] = sentinel
            self._size = 0

    def __len__(self) -> int:
        return self._size

    def popleft(self) -> int:
        """Remove and return the head block. Caller checks ``len(self) > 0``."""
        head = self._next[self._sentinel]
        self.remove(head)
        return head

    def append(self, block_id: int) -> None:
        """Queue ``block_id`` at the tail (evicted last)."""
        sentinel = self._sentinel
        tail = self._prev[sentinel]
        self._next[tail] = block_id
        self._prev[block_id] = tail
        self._next[block_id] = sentinel
        self._prev[sentinel] = block_id
        self._size += 1

    def remove(self, block_id: int) -> None:
        """Unlink ``block_id`` from wherever it is in the queue."""
        nxt = self._next[block_id]
        prv = self._prev[block_id]
        self._next[prv] = nxt
        self._prev[nxt] = prv
        self._size -= 1

    def __iter__(self) -> Iterator[int]:
        """Queued block ids from head (evicted first) to tail."""
        node = self._next[self._sentinel]
        while node != self._sentinel:
            yield node
            node = self._next[node]
