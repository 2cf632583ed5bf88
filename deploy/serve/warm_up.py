"""Warm scale-up: a new engine replica fills its prefix cache from a running one before taking traffic.

When Serve starts an engine replica while others run (autoscaling up, a replaced replica, a rolling
update), the new replica asks the deployment, through its own handle (Serve routes the call to a running
replica: this one is not running yet), for the prefixes whose prefix hits that replica reused most
(``BlockManager.hot_prefixes``, at most ``cache.warm_prefix_tokens`` tokens), and pulls their blocks from the
replica holding them (``kv_pull.py``, with ``cache.kv_peer_pull``), or prefills them (one token each, thrown
away), before its constructor returns. Its first requests then hit the prefix cache as the older
replicas' do, and the cache-aware router, which routes by cached prefixes, sends them work at once.

Best effort: no running replica (the first one of an app), a peer that does not answer within
``PEER_TIMEOUT_S`` or any error only skips the warm-up (logged). ``warm_prefix_tokens`` 0 turns it off.
"""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger(__name__)

PEER_TIMEOUT_S = 30.0


def _running_replicas(app: str, deployment: str) -> int:
    from ray import serve

    status = serve.status().applications.get(app)
    state = status.deployments.get(deployment) if status is not None else None
    return 0 if state is None else state.replica_states.get("RUNNING", 0)


async def warm_from_peers(engine, max_tokens: int) -> dict:
    """Prefills a running peer's hottest prefixes into ``engine`` (a ``ServedEngine``); what it did."""
    from ray import serve

    report = {"prefixes": 0, "tokens": 0, "pulled_tokens": 0, "seconds": 0.0, "skipped": None}
    if max_tokens <= 0:
        report["skipped"] = "warm_prefix_tokens is 0"
        return report
    start = time.monotonic()
    try:
        context = serve.get_replica_context()
        app, deployment = context.app_name, context.deployment
        if await asyncio.to_thread(_running_replicas, app, deployment) == 0:
            report["skipped"] = "no running replica to warm from"
            return report
        handle = serve.get_deployment_handle(deployment, app)
        prefixes = await asyncio.wait_for(handle.hot_prefixes.remote(max_tokens), PEER_TIMEOUT_S)
        report["prefixes"] = len(prefixes)
        report["tokens"], report["pulled_tokens"] = await engine.warm_up(prefixes)
    except Exception as exc:  # noqa: BLE001 - a warm-up is an optimisation: never fail the replica for it
        report["skipped"] = f"{type(exc).__name__}: {exc}"
        log.warning("warm-up skipped: %s", report["skipped"])
    report["seconds"] = time.monotonic() - start
    log.info("warm-up: %d prefixes, %d tokens prefilled and %d pulled in %.1f s", report["prefixes"], report["tokens"],
             report["pulled_tokens"], report["seconds"])
    return report
