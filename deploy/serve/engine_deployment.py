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
- ``abort(request_id)``, ``stats()``, ``check_ready()`` (for /health), ``model_meta()``.
``record_autoscaling_stats`` reports KV usage, running and waiting for ``autoscaling.kv_pressure_policy``.
``record_routing_stats`` is polled by Serve (``request_routing_stats_period_s``) for the request router:
the replica's prefix-cache summary and load (``routing/router.py``). Serve polls it with its default router
too (every 10 s), which reads no summary: build_app then passes ``prefix_summary_blocks=0`` and the
poll leaves the step thread alone (no walk over the cached keys).
``check_health`` is also Serve's replica health hook: a dead engine (a step failure no request owns, rank
restarts used up), a failed step loop or a stalled step makes Serve replace the replica after three
failed checks ``HEALTH_CHECK_PERIOD_S`` apart; a TP group being rebuilt does not (``served_engine.py``).

Draining (``served_engine.py`` holds the state; the same with ``engine_in_ingress``):
- ``drain(timeout_s)``: the replica stops admitting (new requests get ``EngineDrainingError`` -> HTTP
  503 ``engine_draining``; ``check_ready()`` -> /health 503, so load balancers stop sending), waits up to
  ``timeout_s`` for the requests in flight, then aborts the rest (their streams end with
  finish_reason "abort"). Draining is one-way: the replica is then meant to be deleted or replaced.
  ``check_health`` (Serve's hook) stays healthy while draining, so Serve does not kill the replica
  and with it the requests that are finishing.
- Shutdown (``serve delete``, scale-down, redeploy): Serve stops routing to the replica, waits for
  its ongoing calls (the streams in flight) and force-kills it after ``graceful_shutdown_timeout_s``
  (= ``graceful_shutdown_s``; the ingress gets ``SHUTDOWN_MARGIN_S`` more: the failover's placement
  window and 10 s, so that it outlives the engine, continues a stream cut by that kill on the replica a
  redeploy is still starting (Serve stops an old replica as it starts its successor, and a model's replica
  takes seconds to minutes to start), or ends it with an SSE error event, at once when the app is being
  deleted; Serve stops the ingress as soon as its last stream ends). Then it calls ``__del__``,
  which hands whatever is left over (each stream ends as a lost replica's would, and the ingress
  continues it on another replica: ``failover.py``) and stops the TP workers. During ``serve delete`` the Serve proxy
  drops the route at once: new HTTP requests get the proxy's 404 while the ones in flight finish.
  For 503s and a clean cut at a deadline, call ``drain`` before deleting.
"""

from __future__ import annotations

import asyncio
import os

from ray import serve

from ..routing.autoscaling import autoscaling_stats
from ..routing.router import PREFIX_SUMMARY_BLOCKS
from .failover import PLACEMENT_TIMEOUT_S
from .kv_pull import serve_peer_pull
from .loopback import bind_replica_grpc_to_loopback
from .options import GRACEFUL_SHUTDOWN_S
from .peers import own_deployment
from .rebalance import Rebalancer
from .served_engine import ServedEngine, replica_id
from .warm_up import warm_from_peers

ENGINE_DEPLOYMENT_NAME = "PagedEngine"
# Serve calls ``check_health`` this often and replaces a replica after 3 failures in a row (Serve's
# REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD): a dead engine answers 503 for about 15 s, then a new replica
# starts (the model's load time). The timeout is long: a check waits for nothing but a rank ping.
HEALTH_CHECK_PERIOD_S = 5.0
HEALTH_CHECK_TIMEOUT_S = 30.0
SHUTDOWN_MARGIN_S = PLACEMENT_TIMEOUT_S + 10.0  # the ingress outlives the engine by this much on shutdown


def placement_bundles(tensor_parallel_size: int, use_gpu: bool, in_process: bool = False) -> list[dict[str, float]]:
    """Ray executor: bundle 0 is the replica, bundle r + 1 TP rank r. In-process (TP=1, the model runs
    in the replica): one bundle, with the GPU when there is one."""
    if in_process:
        return [{"CPU": 1.0, "GPU": 1.0} if use_gpu else {"CPU": 1.0}]
    rank_bundle = {"GPU": 1.0} if use_gpu else {"CPU": 1.0}
    return [{"CPU": 1.0}] + [dict(rank_bundle) for _ in range(tensor_parallel_size)]


@serve.deployment(name=ENGINE_DEPLOYMENT_NAME, graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
                  health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S)
class EngineDeployment(ServedEngine):
    """ServedEngine's methods are what the ingress calls (``generate``, ``abort``, ``stats``, ``check_ready``,
    ``drain``, ``model_meta``); this class adds Serve's hooks and the per-replica calls.
    ``prefix_summary_blocks``: cached prefix-block hashes per routing summary (0: none, no router reads them).
    Before taking traffic the replica prefills up to ``cache.warm_prefix_tokens`` tokens of a running
    replica's most reused prefixes (``warm_up.py``), pulled from it when ``cache.kv_peer_pull`` (``kv_pull.py``:
    also what a prompt whose prefix a peer holds does). With ``rebalance_threshold`` it moves requests, with their
    blocks, to less loaded peers (``rebalance.py``)."""

    async def __init__(self, config, prefix_summary_blocks: int = PREFIX_SUMMARY_BLOCKS,
                       rebalance_threshold: int = 0) -> None:
        bind_replica_grpc_to_loopback()   # before Serve starts the replica's gRPC server (loopback nodes)
        super().__init__(config)
        self._prefix_summary_blocks = prefix_summary_blocks
        self._rebalancer: Rebalancer | None = None
        self._rebalancing: asyncio.Task | None = None
        cache = self._engine.config.cache     # as the engine settled it (a hybrid pulls nothing: cluster/hybrid.py)
        pull = cache.kv_peer_pull and prefix_summary_blocks and cache.enable_prefix_caching
        if pull or (rebalance_threshold and prefix_summary_blocks):
            peers = own_deployment()      # the cache-aware router's summaries say who holds what, and their loads
            if pull:
                self._pull = serve_peer_pull(self._engine, peers)
            if rebalance_threshold and prefix_summary_blocks:
                self._rebalancer = Rebalancer(self, peers.me, peers.summaries, rebalance_threshold)
        self.warm_report = await warm_from_peers(self, config.cache.warm_prefix_tokens)
        if self._rebalancer is not None:
            self._rebalancing = asyncio.get_running_loop().create_task(self._rebalancer.run())

    def process_id(self) -> int:
        """The replica's pid (memory checks from tests and benchmarks on the same machine)."""
        return os.getpid()

    def process_load(self) -> tuple[str, int, int]:
        """(this replica's Serve id, its pid, the requests it is serving): which process to disturb in a fault
        test or a chaos run so that it hits requests (a call reaches whichever replica the router picks)."""
        return replica_id(), os.getpid(), self._engine.num_in_flight

    async def replica_stats(self):
        """(this replica's Serve id, its EngineStats): per-replica figures for the ingress' /metrics with one
        replica, benchmarks and tools (a call reaches whichever replica the router picks)."""
        return replica_id(), await self.stats()

    def warm_up_report(self) -> tuple[str, dict]:
        """(this replica's Serve id, what its warm-up did: prefixes, tokens, seconds, why it was skipped)."""
        return replica_id(), self.warm_report

    def peer_pull_report(self) -> tuple[str, dict | None]:
        """(this replica's Serve id, its pulls from peers so far: ``kv_pull.PeerPull.report``; None when off)."""
        return replica_id(), None if self._pull is None else self._pull.report()

    def rebalance_report(self) -> tuple[str, dict | None]:
        """(this replica's Serve id, the requests it moved to peers so far: ``Rebalancer.report``; None when off)."""
        return replica_id(), None if self._rebalancer is None else self._rebalancer.report()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """For Serve's custom autoscaling policies (``autoscaling.kv_pressure_policy``)."""
        return autoscaling_stats(await self.stats())

    async def record_routing_stats(self) -> dict:
        return await self.routing_stats(replica_id(), self._prefix_summary_blocks)

    async def __del__(self) -> None:
        # Serve calls this once the ongoing calls are done (or its wait was cut short): hand the rest over
        # (the ingress continues them on another replica). A replica whose constructor failed has no
        # engine: nothing to stop (and no noise in the log).
        if getattr(self, "_rebalancing", None) is not None:
            self._rebalancing.cancel()
        if getattr(self, "_engine", None) is not None:
            await self.close(hand_over=True)
