"""RayWorker: a thin Ray actor around ``Worker`` (one actor per TP rank).

The process group address must be known before any rank builds its ``Worker`` (rank 0 hosts the
TCP store), and the executor learns it from an actor on rank 0's node. So the actor can be created
first and initialised later:

    actors = [RayWorker.options(...).remote(config, rank) for rank in range(tp)]
    ip, port = ray.get(actors[0].node_ip_and_free_port.remote())
    ray.get([a.init_worker.remote(f"tcp://{ip}:{port}") for a in actors])   # all at once: collective

Passing ``dist_init_method`` to the constructor instead builds the Worker immediately (and TP=1
always does). After that the actor offers the Worker's methods unchanged; the executor should
prefer ``execute_bytes`` (msgpack wire form) over ``execute`` (pickled dataclasses).

``ping()`` runs in its own concurrency group (``HEALTH_GROUP``, one thread), so a health check is
answered while a step is running instead of queueing behind it: a rank that does not answer a ping
is really unresponsive, not busy. Every other method stays in the default group, one call at a time.
"""

from __future__ import annotations

import socket

import ray

from .contract.config import EngineConfig
from .contract.wire import StepPlan, StepResult
from .worker import Worker


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


HEALTH_GROUP = "health"
CONCURRENCY_GROUPS = {HEALTH_GROUP: 1}


class RayWorkerBody:
    """The actor class body (``RayWorker`` is ``ray.remote(RayWorkerBody)``)."""

    def __init__(self, config: EngineConfig, rank: int = 0, dist_init_method: str | None = None) -> None:
        self._config = config
        self._rank = rank
        self._worker: Worker | None = None
        if dist_init_method is not None or config.parallel.tensor_parallel_size == 1:
            self.init_worker(dist_init_method)

    def node_ip_and_free_port(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), _free_port()

    def init_worker(self, dist_init_method: str | None) -> None:
        """Build the Worker (joins the TP group: call on every rank concurrently)."""
        if self._worker is not None:
            raise RuntimeError(f"RayWorker rank {self._rank}: init_worker was already called")
        self._worker = Worker(self._config, self._rank, dist_init_method)

    def _get(self) -> Worker:
        if self._worker is None:
            raise RuntimeError(f"RayWorker rank {self._rank}: call init_worker(dist_init_method) first")
        return self._worker

    def available_kv_blocks(self) -> int:
        return self._get().available_kv_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self._get().init_kv_cache(num_blocks)

    def execute(self, plan: StepPlan) -> StepResult | None:
        return self._get().execute(plan)

    def execute_bytes(self, data: bytes) -> bytes | None:
        return self._get().execute_bytes(data)

    def num_sequences(self) -> int:
        return self._get().num_sequences()

    @ray.method(concurrency_group=HEALTH_GROUP)
    def ping(self) -> int:
        """Liveness only (reads no Worker state, so it is safe next to a running step): the rank."""
        return self._rank

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None


RayWorker = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(RayWorkerBody)
