"""An engine replica's view of its peers: a handle to its own deployment, whose cache-aware router (started in
this process by the handle's first call) holds every replica's routing summary (``routing/router.py``). Peer
pulls (``kv_pull.py``) and rebalancing (``rebalance.py``) read the summaries and call peers through it."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OwnDeployment:
    handle: object               # a DeploymentHandle to this replica's own deployment
    app: str
    deployment: str
    me: str                      # this replica's id
    router_started: asyncio.Task

    def summaries(self) -> list[dict] | None:
        """Every replica's last routing summary (``router.replica_summaries``); None before the router has any."""
        from ..routing.router import replica_summaries

        return replica_summaries(self.app, self.deployment)


def own_deployment() -> OwnDeployment:
    """The OwnDeployment of the replica running this code (inside a Serve replica's event loop). Its handle's
    router starts at once (one call, in the background), so that it knows the peers before they are needed."""
    from ray import serve

    context = serve.get_replica_context()
    app, deployment = context.app_name, context.deployment
    handle = serve.get_deployment_handle(deployment, app)

    async def start_router() -> None:
        try:
            await handle.model_meta.remote()
        except Exception as exc:  # noqa: BLE001 - without a router there are no summaries: no pulls, no rebalancing
            log.warning("peers are unknown: the handle to %s did not answer (%s)", deployment, exc)

    started = asyncio.get_running_loop().create_task(start_router())
    return OwnDeployment(handle, app, deployment, context.replica_id.unique_id, started)
