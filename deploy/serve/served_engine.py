"""``ServedEngine``: an ``AsyncEngine`` as one Serve replica serves it (draining, health, meta, shutdown).

Two replicas hold one: the engine deployment (``engine_deployment.py``, the default layout) and, with
``engine_in_ingress``, the ingress itself (``ingress.py``), which uses it as its engine client directly
(it implements ``openai.streaming.EngineClient``), so that both layouts drain, answer health and shut
down the same way.

Health, one name per question: ``check_health`` asks "alive?" (no dead rank, failed step loop or
stalled step; Serve's replica hook), ``check_ready`` asks "alive and taking requests?" (/health, and the
replica states the routers read).

Invariants:
- Draining is one-way: once ``drain`` has begun, ``generate`` refuses (``EngineDrainingError`` -> 503)
  and ``check_ready`` fails, so load balancers stop sending; ``check_health`` stays healthy, so Serve
  does not kill the replica together with the requests that are finishing.
- A TP group being rebuilt after a rank failure is alive but not ready (``AsyncEngine.check_alive``): /health
  says 503 and the routers send elsewhere, while Serve keeps the replica whose streams the rebuild resumes.
- ``close`` aborts whatever is still running and stops the TP workers; it is safe to call twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from pagedray.cluster.kv_transfers import KVExport
from pagedray.cluster.outputs import EngineDrainingError, RequestOutput, merge_deltas
from pagedray.cluster.pooling import PoolingSettings
from pagedray.workers.contract.config import EngineConfig
from pagedray.workers.contract.lora_request import LoRARequest
from pagedray.workers.contract.sampling_params import SamplingParams

from ..openai.metrics import ReplicaState
from .kv_pull import PeerPull, fetch_shards, put_shards

log = logging.getLogger(__name__)


async def _as_is(export: KVExport) -> KVExport:
    return export


def replica_id() -> str:
    """This Serve replica's id."""
    from ray import serve

    return serve.get_replica_context().replica_id.unique_id


@dataclass(frozen=True)
class DrainReport:
    in_flight_at_start: int   # requests being generated or waiting when the drain began
    aborted: int              # of those, still unfinished at the timeout (aborted)
    seconds: float            # how long the drain took


@dataclass(frozen=True)
class ModelMeta:
    """What the ingress needs to validate and detokenize without asking the engine again."""

    model_path: str
    tokenizer_path: str
    vocab_size: int
    max_model_len: int
    dtype: str                # the dtype the ranks run (``dtype`` "auto" resolved)
    max_num_seqs: int         # the scheduler's sequences per step
    lora_adapters: tuple[tuple[str, str], ...] = ()   # (name, folder) of the adapters served (lora_modules)
    pooling: PoolingSettings = PoolingSettings()      # task, pooling type, ... (the pooling endpoints)


class ServedEngine:
    def __init__(self, config: EngineConfig) -> None:
        from pagedray.cluster.async_engine import AsyncEngine

        self._config = config
        self._draining = False
        self._closed = False
        self._engine = AsyncEngine(config)
        self._pull: PeerPull | None = None     # set by the engine deployment when peers may hold prefixes
        self._moved_in: set[str] = set()       # requests in flight here that another replica moved here

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       resume_tokens: list[int] = (), lora: LoRARequest | None = None, session: str | None = None,
                       tenant: str | None = None, kv: KVExport | None = None, exclude: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """``kv``: the prompt's blocks from the replica that ran it (prefill/decode disaggregation, a moved request),
        imported first; an import that fails (a lost exporter, another layout) leaves the prompt to be computed here.
        ``exclude``: the replica a moved request left (``hand_over``; the router never sends it back there): this
        replica never moves it again."""
        # an async generator function, not a method returning AsyncEngine's generator: Serve runs a
        # plain method in its thread pool and streams only what a generator function yields
        if kv is not None and not self._draining:
            await self._import_handed_over(kv)
        elif self._pull is not None and not self._draining:
            await self._pull.before_prefill(prompt_token_ids, lora)
        if exclude is not None:
            self._moved_in.add(request_id)
        try:
            async for output in self._engine.generate(request_id, prompt_token_ids, params,
                                                      resume_tokens=resume_tokens, lora=lora, session=session,
                                                      tenant=tenant):
                yield output
        finally:
            self._moved_in.discard(request_id)

    async def hand_over(self, count: int, source: str) -> list[str]:
        """Moves up to ``count`` of this replica's requests to other replicas, with their KV blocks (each rank's
        shard put into the object store; ``AsyncEngine.hand_over``, ``rebalance.py``); ``source``: this replica's
        id, which their continuations avoid. Requests moved here are never moved again. Returns the ids moved."""
        if self._draining:
            return []
        return await self._engine.hand_over(count, source, put_shards, keep=frozenset(self._moved_in))

    async def _import_handed_over(self, kv: KVExport) -> None:
        try:
            await self.import_prefix(kv)
        except Exception as exc:  # noqa: BLE001 - the blocks are an optimisation: the prompt is computed instead
            log.warning("the prompt's KV blocks could not be imported (%s: %s); they are computed here",
                        type(exc).__name__, exc)

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      lora: LoRARequest | None = None, session: str | None = None, tenant: str | None = None
                      ) -> AsyncIterator[RequestOutput | KVExport]:
        """Prefill/decode disaggregation, the prefill side (``disaggregation.py``): runs the request to its first
        output with tokens and yields it at once, stops the request there, and yields a KVExport of the prompt's
        cached blocks (shards in the object store) unless that output was the request's last."""
        first = None
        async with aclosing(self._engine.generate(request_id, prompt_token_ids, params, lora=lora, session=session,
                                                  tenant=tenant)) as outputs:
            async for out in outputs:
                first = out if first is None else merge_deltas(first, out)
                if out.finished or any(c.token_ids for c in out.outputs):
                    break
        if first is None:
            return
        yield first
        if not first.finished:              # closing the stream above aborted the request: its blocks stay cached
            yield await self.export_prefix(prompt_token_ids, lora)

    async def export_prefix(self, token_ids: list[int], lora: LoRARequest | None = None,
                            exclude: str | None = None) -> KVExport:
        """This replica's cached blocks of ``token_ids`` (``kv_pull.py``), each rank's shard in the object store.
        ``exclude``: the calling replica, which the router never sends this call to."""
        return await put_shards(await self._engine.export_prefix(token_ids, lora))

    async def import_prefix(self, export: KVExport) -> int:
        """Imports another replica's export (shards as bytes or ObjectRefs): the tokens of it cached here."""
        return await self._engine.import_prefix(await fetch_shards(export))

    async def abort(self, request_id: str) -> bool:
        return await self._engine.abort(request_id)

    async def stats(self):
        return await self._engine.stats()

    async def check_lora(self, lora: LoRARequest) -> None:
        """ValueError naming the problem unless this replica can serve adapter ``lora`` (a run-time load)."""
        await self._engine.check_lora(lora)

    async def check_health(self) -> None:
        """Alive (Serve's replica health hook): raises for a dead rank, a failed step loop or a stalled step;
        not while the TP group is being rebuilt (module doc)."""
        await self._engine.check_alive()

    async def check_ready(self) -> None:
        """Alive and taking requests (/health): also fails while draining (stop sending traffic here) and while
        the TP group is being rebuilt."""
        if self._draining:
            raise EngineDrainingError("the engine is draining and accepts no new requests")
        await self._engine.check_health()

    async def _health_state(self) -> tuple[bool, str]:
        """Whether the engine serves (``AsyncEngine.check_health``: a rebuild counts as down) as (healthy, the
        reason when not), for reports that must not raise."""
        try:
            await self._engine.check_health()
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            return False, str(exc)
        return True, ""

    async def replica_states(self) -> list[ReplicaState]:
        """This replica, the only one an ingress holding the engine sees (``EngineClient``)."""
        healthy, reason = await self._health_state()
        return [ReplicaState(replica_id(), await self.stats(), healthy, reason)]

    async def drain(self, timeout_s: float) -> DrainReport:
        """Refuse new requests, let the in-flight ones finish for ``timeout_s``, abort the rest."""
        if not timeout_s >= 0:
            raise ValueError(f"timeout_s: must be >= 0, got {timeout_s!r}")
        self._draining = True
        start, in_flight = time.monotonic(), self._engine.num_in_flight
        aborted = await self._engine.drain(timeout_s)
        return DrainReport(in_flight, aborted, time.monotonic() - start)

    async def routing_stats(self, replica: str, max_blocks: int) -> dict:
        """The replica's summary for cache-aware routing (``routing/router.py``) and for the ingress'
        /metrics and /health: hashes of at most ``max_blocks`` cached prefix blocks, its EngineStats as a
        dict (the router reads the load from it), whether its engine is healthy (dead / stalled;
        draining is not unhealthy here), the LoRA adapters resident in its slots, and with a second KV tier the
        hashes of at most ``max_blocks`` blocks there with what one is worth against a cached block
        (``cluster/tier_cost.py``). ``max_blocks`` 0: no hashes, and no wait for the step thread."""
        stats = await self._engine.stats()
        healthy, reason = await self._health_state()
        hashes = await self._engine.cached_prefix_hashes(max_blocks) if max_blocks else []
        tier_hashes, tier_weight = [], 0.0
        if max_blocks and self._config.cache.kv_offload_gib > 0:
            tier_hashes, tier_weight = await self._engine.tier_summary(max_blocks)
        return {"replica": replica, "prefix_hashes": hashes, "stats": stats.to_dict(), "healthy": healthy,
                "reason": reason, "lora_resident": self._engine.resident_adapters(), "tier_hashes": tier_hashes,
                "tier_weight": tier_weight}

    async def hot_prefixes(self, max_tokens: int) -> list[list[int]]:
        """The prefixes this replica's prefix hits reused most, within ``max_tokens`` tokens (``warm_up.py``)."""
        return await self._engine.hot_prefixes(max_tokens)

    async def warm_up(self, prefixes: list[list[int]]) -> tuple[int, int]:
        """Puts ``prefixes`` into this replica's prefix cache: pulled from the peer holding them (``kv_pull.py``,
        when pulls are on), else prefilled (one token generated each, thrown away); returns (the prompt tokens
        run, the tokens pulled)."""
        pulled = 0
        if self._pull is not None:
            bs, left = self._config.cache.block_size, []
            for tokens in prefixes:
                got = await self._pull.pull(tokens, None)
                pulled += got
                if got < len(tokens) // bs * bs:
                    left.append(tokens)
            prefixes = left
        async def prefill(i: int, tokens: list[int]) -> None:
            async for _ in self._engine.generate(f"warm-up-{i}", tokens, SamplingParams(max_tokens=1, temperature=0)):
                pass

        usable = [p for p in prefixes if 0 < len(p) < self._engine.max_model_len]
        batch = max(1, min(self._config.scheduler.max_queued_requests, self._config.scheduler.max_num_seqs))
        for start in range(0, len(usable), batch):     # within the admission queue's bound
            await asyncio.gather(*(prefill(start + i, p) for i, p in enumerate(usable[start:start + batch])))
        return sum(len(p) for p in usable), pulled

    def model_meta(self) -> ModelMeta:
        engine = self._engine
        return ModelMeta(model_path=engine.model_path,
                         tokenizer_path=self._config.model.tokenizer or engine.model_path,
                         vocab_size=engine.vocab_size, max_model_len=engine.max_model_len,
                         dtype=engine.dtype, max_num_seqs=self._config.scheduler.max_num_seqs,
                         lora_adapters=tuple(self._config.model.lora_module_paths().items()),
                         pooling=PoolingSettings.of(self._config.model, engine.engine.model_info))

    async def close(self, hand_over: bool = False) -> None:
        """Stops the engine; the requests still in flight are aborted, or (``hand_over``) end as the
        requests of a lost replica, which an ingress with failover continues elsewhere."""
        if self._closed:
            return
        self._closed, self._draining = True, True
        try:
            # the blocks travel inside the hand-over outputs: this replica's object-store entries would go with it
            await self._engine.drain(0.0, hand_over=hand_over, pack=_as_is if hand_over else None)
        finally:
            self._engine.shutdown()
