"""Rebalancing between live engine replicas: a busy replica moves running requests, with their KV blocks, to a
less loaded one (#65's planned migration; ``rebalance_threshold``).

Why: the router places a request once, when it arrives. Long decodes then stay where they started, so a
replica added by autoscaling takes only new requests while an old one keeps a full batch (longer steps,
requests waiting for a slot), and a burst of one prefix lands on the replica that holds it.

Who decides: each engine replica for itself, every ``REBALANCE_PERIOD_S``. Its own load is live (running +
waiting, its EngineStats); its peers' loads come from the routing summaries the cache-aware router in its
process holds (``routing/router.py``, at most ``ROUTING_STATS_PERIOD_S`` old). When its load exceeds the
least-loaded healthy peer's by more than ``threshold``, it hands half the difference over
(``ServedEngine.hand_over``): waiting requests first, then the running ones with the most tokens left. After a
move it waits ``COOLDOWN_S``, long enough for every summary to show the move, before it decides again.

How a request moves (``AsyncEngine.hand_over``): its blocks are exported (prompt and output so far) and each
rank's shard is put into the object store; its stream ends with an output marked ``moved_from`` that carries
them; the ingress's failover client sends the continuation at once (``failover.py``: not a failover) with
``exclude`` naming this replica, and the router places it on the least-loaded other replica, which imports the
blocks and computes only the last partial block. Greedy and seeded streams go on token for token (the
continuation semantics of a failover). A request moved to a replica is never moved again from there, so a
request cannot bounce between two replicas; n > 1 requests are not moved (their samples share blocks).

Off by default (``threshold`` 0): a move pauses the stream for one export and one import.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ..routing.router import ROUTING_STATS_PERIOD_S

log = logging.getLogger(__name__)

REBALANCE_PERIOD_S = 2 * ROUTING_STATS_PERIOD_S
COOLDOWN_S = 3 * ROUTING_STATS_PERIOD_S   # after a move: the peers' summaries show it before the next decision


def load_of(stats: dict) -> int:
    """Requests running and waiting, from an EngineStats dict (what the router calls a replica's load)."""
    return int(stats.get("num_running", 0)) + int(stats.get("num_waiting", 0))


def surplus(my_load: int, summaries: list[dict], me: str, threshold: int) -> int:
    """How many requests replica ``me`` (load ``my_load``) should hand over: half its excess over the least-loaded
    healthy peer in ``summaries`` when that excess is above ``threshold``; 0 when not, when there is no peer
    or when ``threshold`` is 0 (off)."""
    if threshold < 0:
        raise ValueError(f"threshold: must be >= 0, got {threshold}")
    peers = [load_of(s.get("stats") or {}) for s in summaries if s.get("replica") != me and s.get("healthy", True)]
    if threshold == 0 or not peers:
        return 0
    excess = my_load - min(peers)
    return excess // 2 if excess > threshold else 0


class Rebalancer:
    """The rebalancing of one engine replica (``served``: its ServedEngine; ``me``: its replica id;
    ``summaries()``: every replica's routing summary, or None before the router has them)."""

    def __init__(self, served, me: str, summaries: Callable[[], list[dict] | None], threshold: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if threshold < 1:
            raise ValueError(f"rebalance_threshold: must be >= 1 to rebalance, got {threshold}")
        self.served, self.me, self.threshold = served, me, threshold
        self._summaries, self._clock = summaries, clock
        self._quiet_until = float("-inf")
        self.num_moves = self.num_moved = 0

    async def tick(self) -> int:
        """One decision (and the move it calls for): the number of requests moved."""
        if self._clock() < self._quiet_until:
            return 0
        stats = await self.served.stats()
        count = surplus(stats.num_running + stats.num_waiting, self._summaries() or [], self.me, self.threshold)
        if count == 0:
            return 0
        moved = await self.served.hand_over(count, self.me)
        if moved:
            self.num_moves += 1
            self.num_moved += len(moved)
            self._quiet_until = self._clock() + COOLDOWN_S
            log.info("rebalancing: moved %d requests to less loaded replicas", len(moved))
        return len(moved)

    async def run(self) -> None:
        """``tick`` every ``REBALANCE_PERIOD_S`` until cancelled; a failed tick is logged and the next one runs."""
        while True:
            await asyncio.sleep(REBALANCE_PERIOD_S)
            try:
                await self.tick()
            except Exception as exc:  # noqa: BLE001 - rebalancing is an optimisation: never stop the replica for it
                log.warning("rebalancing skipped a round (%s: %s)", type(exc).__name__, exc)

    def report(self) -> dict:
        return {"threshold": self.threshold, "moves": self.num_moves, "moved_requests": self.num_moved}
