"""Prefill/decode disaggregation: prompts run on prefill replicas, their requests go on in decode replicas.

``prefill_replicas: N`` (build_app) adds a second engine deployment, ``PagedEnginePrefill``, beside the decode
one (``num_replicas`` / ``decode_replicas``). For each request the ingress's ``DisaggregatedEngineClient``:
1. streams a prefill replica's ``prefill`` (routed by the cache-aware router among the prefill replicas): the
   replica runs the request until its first output with tokens and sends it, stops the request there, and
   sends a KVExport of the prompt's cached blocks, each rank's shard in the object store
   (``kv_pull.put_shards``);
2. passes that first output to the client as it arrives (its TTFT is the prefill replica's);
3. continues the request on a decode replica (chosen by the router: its load, and the prompt's blocks it may
   hold) as a continuation (``resume_tokens``: the tokens the prefill produced) that imports the blocks first
   (``ServedEngine.generate(kv=...)``): the decode replica computes only the prompt's last partial block and
   the resumed tokens, then samples on from the next position exactly as one replica would have (greedy and
   seeded draws depend on the position; ``Engine.add``). Its stream goes through the failover client: a lost
   decode replica's requests continue on another one.

Not disaggregated (they run on a decode replica from the start, as without prefill replicas): ``n > 1``
(each sample would need its own hand-over) and ``prompt_logprobs``. A prefill replica that is lost, refuses
(full, draining) or fails before its first output leaves the request to a decode replica from the start too. A
hand-over whose blocks cannot be imported (the prefill replica died before the decode replica fetched them)
is computed on the decode replica: slower, the same tokens. ``usage.kv_block_seconds`` counts the decode
replica's part only (as a failover continuation's does).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from pagedray.cluster.outputs import EngineDrainingError, QueueFullError, RequestOutput
from pagedray.workers.contract.sampling_params import SamplingParams

from .failover import REPLICA_LOST

PREFILL_DEPLOYMENT_NAME = "PagedEnginePrefill"


def disaggregable(params: SamplingParams) -> bool:
    return params.n == 1 and params.prompt_logprobs is None


class DisaggregatedEngineClient:
    """The ingress's EngineClient with prefill replicas (``prefill``: a handle to their deployment) in front of
    ``decode`` (the failover client of the decode deployment); everything but ``generate`` is ``decode``'s."""

    def __init__(self, prefill, decode) -> None:
        self._prefill, self._decode = prefill.options(stream=True), decode

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       lora=None, session=None, tenant=None) -> AsyncIterator[RequestOutput]:
        first, export = None, None
        if disaggregable(params):
            stream = self._prefill.prefill.remote(f"{request_id}:prefill", prompt_token_ids, params, lora, session,
                                                  tenant)
            try:
                first = await anext(aiter(stream), None)
            except (*REPLICA_LOST, QueueFullError, EngineDrainingError):
                first = None        # the decode replicas run it from the start
        if first is None:
            async for out in self._decode.generate(request_id, prompt_token_ids, params, lora=lora, session=session,
                                                   tenant=tenant):
                yield out
            return
        yield replace(first, request_id=request_id)
        if first.finished:
            return
        try:
            export = await anext(aiter(stream), None)
        except REPLICA_LOST:
            export = None           # the prefill replica went after the first token: the decode side computes it
        tokens = first.outputs[0].token_ids
        async for out in self._decode.generate(request_id, prompt_token_ids, params, lora=lora, session=session,
                                               tenant=tenant, resume_tokens=tokens, kv=export):
            # the prompt was reported once, by the prefill replica
            yield replace(out, prompt_token_ids=None, prompt_logprobs=None,
                          num_cached_prompt_tokens=first.num_cached_prompt_tokens)

    async def stats(self):
        return await self._decode.stats()

    async def replica_states(self) -> list:
        return await self._decode.replica_states()

    async def check_ready(self) -> None:
        await self._decode.check_ready()

    async def check_lora(self, lora) -> None:
        await self._decode.check_lora(lora)
