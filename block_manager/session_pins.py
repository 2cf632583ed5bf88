"""SessionPins: the KV blocks of each session's last prompt and output, pinned for a while.

An agent's next turn extends its last prompt and output; if those blocks were evicted between turns, the
whole context is prefilled again. A session (OpenAI's ``prompt_cache_key``, or an ``X-Session-Id`` header)
pins the cached blocks of its last finished request for ``ttl_s``: while free they wait in the pool's pinned
free queue, which ``BlockPool.allocate`` takes from only when no other block is free (evicted last, not never).

Rules:
- ``pin(session, blocks, now)`` replaces the session's pins with ``blocks`` (prefix order), expiring at
  ``now + ttl_s``. Pins never exceed ``budget`` blocks in all: to make room, expired sessions go first, then
  the sessions pinned longest ago; a session alone over the budget keeps the first ``budget`` blocks of its
  prefix (the part every later turn needs).
- ``expire(now)`` unpins the sessions whose time is up (the scheduler calls it once a step).
- A pin is on a block id; the block's key at pin time is kept with it, and a block handed out again (its key
  evicted, its pins dropped by the pool) is not unpinned twice: ``unpin`` only touches blocks still holding
  the pinned key.

The clock is the caller's (``now`` in seconds): tests pass their own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from .block_pool import BlockPool
from .prefix_key import BlockKey


class SessionPins:
    def __init__(self, pool: BlockPool, budget: int, ttl_s: float) -> None:
        if type(budget) is not int or budget < 0:  # noqa: E721
            raise ValueError(f"budget: must be an integer >= 0, got {budget!r}")
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not ttl_s > 0:
            raise ValueError(f"ttl_s: must be a number > 0, got {ttl_s!r}")
        self.pool, self.budget, self.ttl_s = pool, budget, float(ttl_s)
        # session -> (expiry, [(block, key)]), in expiry order (a fixed TTL: the order pins were made)
        self._sessions: OrderedDict[Hashable, tuple[float, list[tuple[int, BlockKey]]]] = OrderedDict()
        self.num_pinned = 0      # pins held, summed over sessions (<= budget)

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def pinned_blocks(self, session: Hashable) -> list[int]:
        """The blocks ``session`` pins (still holding the key they were pinned with), prefix order."""
        entry = self._sessions.get(session)
        return [] if entry is None else [b for b, key in entry[1] if self.pool.key_of(b) is key]

    def pin(self, session: Hashable, blocks: list[int], now: float) -> int:
        """Pins ``session``'s blocks (cached full blocks, prefix order; others are skipped) in place of its
        earlier ones; returns how many were pinned."""
        self._drop(session)
        self.expire(now)
        keyed = [(b, key) for b in blocks if (key := self.pool.key_of(b)) is not None][:self.budget]
        while self.num_pinned + len(keyed) > self.budget:
            self._drop(next(iter(self._sessions)))
        if not keyed:                 # nothing to keep: no entry (a flood of one-off sessions holds no memory)
            return 0
        for block_id, _ in keyed:
            self.pool.pin(block_id)
        self._sessions[session] = (now + self.ttl_s, keyed)
        self.num_pinned += len(keyed)
        return len(keyed)

    def expire(self, now: float) -> int:
        """Unpins every session whose pins expired at or before ``now``; returns how many sessions."""
        expired = 0
        while self._sessions:
            session, (expiry, _) = next(iter(self._sessions.items()))
            if expiry > now:
                break
            self._drop(session)
            expired += 1
        return expired

    def _drop(self, session: Hashable) -> None:
        entry = self._sessions.pop(session, None)
        if entry is None:
            return
        for block_id, key in entry[1]:
            if self.pool.key_of(block_id) is key:
                self.pool.unpin(block_id)
        self.num_pinned -= len(entry[1])
