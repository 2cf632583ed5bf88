"""The engine deployment: one Serve replica = one central actor wrapping ``AsyncEngine``.

Executor (``executor`` in build_app's args): ``ray`` (the default) runs one Ray worker actor per TP
rank (``RayExecutor``; a dead worker is rebuilt by TP-rank recovery); ``local`` (or ``auto`` at TP=1)
runs the model in this replica's own process (``LocalExecutor``, like vLLM's single-process executor:
no worker process and no Ray call per step; a crash of the model takes the replica down and Serve
replaces it). app.py says why ``ray`` is the default.

Placement with the Ray executor: ``placement_group_bundles = [{"CPU": 1}] + [{"GPU": 1} | {"CPU": 1}] *
tensor_parallel_size``. Bundle 0 holds this replica (the scheduler and block manager); bundle ``r + 1``
holds TP rank r, so that the TP worker actors land in the replica's own placement group (the executor
picks the group up from the replica) and Serve reserves and releases the whole gang together.
In-process: one bundle ``{"CPU": 1}`` (plus ``"GPU": 1`` on a GPU node) for the replica and its model.

Methods called by the ingress through a DeploymentHandle:
- ``generate(request_id, prompt_token_ids, params)``: async generator of RequestOutput deltas;
  cancelling the call (``DeploymentResponseGenerator.cancel()``, or the ingress request being
  cancelled) cancels the iteration here, and AsyncEngine then aborts the request (blocks freed
  within a step).
- ``abort(request_id)``, ``stats()``, ``health()``, ``model_meta()``.
``check_health`` is also Serve's replica health hook: a dead rank, a failed step loop or a stalled
step makes Serve replace the replica.

Draining (decided here):
- ``drain(timeout_s)``: the replica stops admitting (new requests get ``EngineDrainingError`` -> HTTP
  503 ``engine_draining``; ``health()`` -> /health 503, so load balancers stop sending), waits up to
  ``timeout_s`` for the requests in flight, then aborts the rest (their streams end with
  finish_reason "abort"). Draining is one-way: the replica is then meant to be deleted or replaced.
  ``check_health`` (Serve's hook) stays healthy while draining, so Serve does not kill the replica
  and with it the requests that are finishing.
- Shutdown (``serve delete``, scale-down, redeploy): Serve stops routing to the replica, waits for
  its ongoing calls (the streams in flight) and force-kills it after ``graceful_shutdown_timeout_s``
  (= ``graceful_shutdown_s``; the ingress gets ``SHUTDOWN_MARGIN_S`` more, so that it outlives the
  engine and can end a stream cut by that kill with an SSE error event). Then it calls ``__del__``,
  which aborts whatever is left and stops the TP workers. During ``serve delete`` the Serve proxy
  drops the route at once: new HTTP requests get the proxy's 404 while the ones in flight finish.
  For 503s and a clean cut at a deadline, call ``drain`` before deleting.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagedray.cluster.outputs import EngineDrainingError, RequestOutput
from pagedray.workers.contract.config import EngineConfig
from pagedray.workers.contract.sampling_params import SamplingParams
from ray import serve

from .options import GRACEFUL_SHUTDOWN_S

ENGINE_DEPLOYMENT_NAME = "PagedEngine"
SHUTDOWN_MARGIN_S = 10.0  # the ingress outlives the engine by this much on shutdown


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


def placement_bundles(tensor_parallel_size: int, use_gpu: bool, in_process: bool = False) -> list[dict[str, float]]:
    """Ray executor: bundle 0 is the replica, bundle r + 1 TP rank r. In-process (TP=1, the model runs
    in the replica): one bundle, with the GPU when there is one."""
    if in_process:
        return [{"CPU": 1.0, "GPU": 1.0} if use_gpu else {"CPU": 1.0}]
    rank_bundle = {"GPU": 1.0} if use_gpu else {"CPU": 1.0}
    return [{"CPU": 1.0}] + [dict(rank_bundle) for _ in range(tensor_parallel_size)]


@serve.deployment(name=ENGINE_DEPLOYMENT_NAME, graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
                  health_check_period_s=10.0, health_check_timeout_s=30.0)
class EngineDeployment:
    def __init__(self, config: EngineConfig) -> None:
        from pagedray.cluster.async_engine import AsyncEngine

        self._config = config
        self._draining = False
        self._engine = AsyncEngine(config)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        async for output in self._engine.generate(request_id, prompt_token_ids, params):
            yield output

    async def abort(self, request_id: str) -> bool:
        return await self._engine.abort(request_id)

    async def stats(self):
        return await self._engine.stats()

    async def health(self) -> None:
        """For the ingress' /health: also unhealthy while draining (stop sending traffic here)."""
        if self._draining:
            raise EngineDrainingError("the engine is draining and accepts no new requests")
        await self._engine.check_health()

    async def drain(self, timeout_s: float) -> DrainReport:
        """Refuse new requests, let the in-flight ones finish for ``timeout_s``, abort the rest."""
        if not timeout_s >= 0:
            raise ValueError(f"timeout_s: must be >= 0, got {timeout_s!r}")
        self._draining = True
        start, in_flight = time.monotonic(), self._engine.num_in_flight
        aborted = await self._engine.drain(timeout_s)
        return DrainReport(in_flight, aborted, time.monotonic() - start)

    def process_id(self) -> int:
        """The replica's pid (memory checks from tests and benchmarks on the same machine)."""
        return os.getpid()

    async def check_health(self) -> None:
        await self._engine.check_health()

    def model_meta(self) -> ModelMeta:
        engine = self._engine
        return ModelMeta(model_path=engine.model_path,
                         tokenizer_path=self._config.model.tokenizer or engine.model_path,
                         vocab_size=engine.vocab_size, max_model_len=engine.max_model_len)

    async def __del__(self) -> None:
        # Serve calls this once the ongoing calls are done (or its wait was cut short): abort the rest.
        # A replica whose constructor failed has no engine: nothing to stop (and no noise in the log).
        if getattr(self, "_engine", None) is None:
            return
        self._draining = True
        try:
            await self._engine.drain(0.0)
        finally:
            self._engine.shutdown()
