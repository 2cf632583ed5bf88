"""Pull instead of prefill: an engine replica that receives a prompt whose cached prefix a peer replica holds
copies the peer's blocks (``cluster/kv_transfers.py``) when that is measured to be faster than computing them.

Transport: the peer's engine exports the blocks, the peer replica puts each rank's shard into the Ray object
store (``ray.put``: it works on one node and across nodes) and returns the refs in the KVExport; this replica
fetches them (``await ref``) and imports. A peer that dies mid-transfer fails the fetch: the prompt is prefilled
instead (logged), and nothing is lost. A peer with another layout (model, block size, dtype, KV dtype) is
refused by the import: prefilled too.

Which peer: this replica holds a handle to its own deployment, whose cache-aware router in this process holds
every replica's routing summary (``routing/router.py``). The prompt's leading blocks that the best peer
reports, beyond those this replica reports, are the gain. The export call goes through that router, which
sends ``export_prefix`` to the replica holding the longest run and never back to the caller.

When: a gain of at least one block, and either a cost not measured yet (the first pull measures it) or the
measured seconds per pulled block below the measured seconds per computed block (``Engine.tier_cost``: prefill
seconds per token x block size). Each pull updates its cost: the wall time from the export call to the import's
end, per block moved. Continuations of streams cut by a lost replica take the same path (their prompt is a
prompt), and so does warm scale-up (``warm_up.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time

from pagedray.block_manager import prefix_block_hashes
from pagedray.cluster.kv_transfers import KVExport
from pagedray.workers.contract.lora_request import LoRARequest

from ..routing.router import leading_blocks_held
from .peers import OwnDeployment

log = logging.getLogger(__name__)

EXPORT_METHOD = "export_prefix"   # the engine deployment's method the router sends to the best holder
SMOOTHING = 0.2                   # weight of the newest pull in the cost's moving average


async def fetch_shards(export: KVExport) -> KVExport:
    """``export`` with its shards as bytes (ObjectRefs fetched from the object store; bytes kept)."""
    shards = [shard if isinstance(shard, (bytes, bytearray)) else await shard for shard in export.shards]
    return KVExport(export.layout, export.namespace, export.token_ids, shards)


class PeerPull:
    """Decides and runs the pulls of one engine replica (``engine``: its AsyncEngine). ``summaries()``: the
    routing summaries of every replica (None before the router has any); ``export(tokens, lora)``: a call of
    a peer's ``export_prefix`` through the router, returning its KVExport; ``me``: this replica's id."""

    def __init__(self, engine, block_size: int, me: str, summaries, export) -> None:
        self.engine, self.block_size, self.me = engine, block_size, me
        self._summaries, self._export = summaries, export
        self.seconds_per_block: float | None = None
        self.num_pulls = self.num_pulled_blocks = self.num_failures = 0
        self._memo: dict[str, tuple[list, frozenset[int]]] = {}
        self._pulls: dict[tuple, asyncio.Future] = {}     # pulls in flight, by the blocks they bring



    def _held(self, summary: dict, hashes: list[int]) -> int:
        reported = summary.get("prefix_hashes") or []
        memo = self._memo.get(summary["replica"])
        if memo is None or memo[0] is not reported:
            memo = (reported, frozenset(reported))
            self._memo[summary["replica"]] = memo
        return leading_blocks_held(hashes, memo[1])

    def gain(self, prompt: list[int], lora: LoRARequest | None) -> int:
        """Blocks of ``prompt``'s cached run (leaving >= 1 token, as a prefill would) that the best healthy peer
        holds beyond what this replica holds, by their last summaries; 0 when none."""
        summaries = self._summaries() or []
        usable = prompt[:len(prompt) - 1]
        if len(usable) < self.block_size or len(summaries) < 2:
            return 0
        hashes = prefix_block_hashes(usable, self.block_size, None if lora is None else lora.cache_namespace)
        mine, best = 0, 0
        for summary in summaries:
            held = self._held(summary, hashes)
            if summary["replica"] == self.me:
                mine = held
            elif summary.get("healthy", True):
                best = max(best, held)
        return max(0, best - mine)

    def worth_it(self, blocks: int) -> bool:
        compute = self.engine.engine.tier_cost.compute_s_per_token
        if blocks < 1:
            return False
        if self.seconds_per_block is None or compute is None:
            return True                         # not measured yet: this pull measures it
        return self.seconds_per_block < compute * self.block_size

    async def before_prefill(self, prompt: list[int], lora: LoRARequest | None) -> int:
        """Pulls ``prompt``'s prefix from a peer when ``gain`` and ``worth_it`` say so: the tokens pulled."""
        blocks = self.gain(prompt, lora)
        if not self.worth_it(blocks):
            return 0
        return await self.pull(prompt[:len(prompt) - 1], lora)

    async def pull(self, tokens: list[int], lora: LoRARequest | None) -> int:
        """Imports a peer's cached blocks of ``tokens`` (whole blocks): the tokens now cached here from them (0 on
        failure). Prompts arriving together with one prefix share one pull: a burst of them moves it once."""
        tokens = list(tokens[:len(tokens) // self.block_size * self.block_size])
        key = (None if lora is None else lora.cache_namespace, len(tokens), hash(tuple(tokens)))
        pending = self._pulls.get(key)
        if pending is None:
            pending = self._pulls[key] = asyncio.ensure_future(self._pull(tokens, lora))
            pending.add_done_callback(lambda _: self._pulls.pop(key, None))
        return await asyncio.shield(pending)

    async def _pull(self, tokens: list[int], lora: LoRARequest | None) -> int:
        started = time.perf_counter()
        try:
            export = await self._export(tokens, lora)
            if export.num_blocks == 0:
                return 0
            cached = await self.engine.import_prefix(await fetch_shards(export))
        except Exception as exc:  # noqa: BLE001 - a pull is an optimisation: the prompt is prefilled instead
            self.num_failures += 1
            log.warning("pulling %d tokens from a peer failed (%s: %s); they are computed here", len(tokens),
                        type(exc).__name__, exc)
            return 0
        elapsed = time.perf_counter() - started
        per_block = elapsed / export.num_blocks
        self.seconds_per_block = per_block if self.seconds_per_block is None else (
            (1 - SMOOTHING) * self.seconds_per_block + SMOOTHING * per_block)
        self.num_pulls += 1
        self.num_pulled_blocks += export.num_blocks
        return cached

    def report(self) -> dict:
        return {"pulls": self.num_pulls, "pulled_blocks": self.num_pulled_blocks, "failures": self.num_failures,
                "seconds_per_block": self.seconds_per_block}


async def put_shards(export: KVExport) -> KVExport:
    """``export`` with each shard put into the Ray object store (the exporting replica owns the objects); as it
    is without Ray (engines in one process: the bytes go by reference)."""
    import ray

    if not ray.is_initialized():
        return export
    refs = await asyncio.to_thread(lambda: [ray.put(shard) for shard in export.shards])
    return KVExport(export.layout, export.namespace, export.token_ids, refs)


def serve_peer_pull(engine, peers: OwnDeployment) -> PeerPull:
    """The PeerPull of the engine replica running this code (``engine``: its AsyncEngine; ``peers``: a handle to its
    own deployment, whose cache-aware router holds every replica's summary)."""
    async def export(tokens: list[int], lora: LoRARequest | None) -> KVExport:
        return await peers.handle.export_prefix.remote(tokens, lora, exclude=peers.me)

    return PeerPull(engine, engine.config.cache.block_size, peers.me, peers.summaries, export)
