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

The actor stays a plain (single-threaded) actor: calls run one at a time on its main thread. A health
ping in a concurrency group of its own would not queue behind a step, but it turns the actor into a
threaded one whose steps run slower (torch on a non-main thread, docs/design/workers.md); the
executor instead skips the ping while a step is in flight (ray_executor.py). With
``ray_transport="socket"`` the steps come over a TCP connection instead (step_channel.py):
``open_step_channel`` listens, then one long ``serve_step_channel`` call answers the steps on the main
thread until the engine closes the connection.
"""

from __future__ import annotations

import os
import socket

import ray

from .contract.config import EngineConfig
from .contract.wire import StepPlan, StepResult
from .step_channel import StepChannelServer
from .worker import Worker


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class RayWorkerBody:
    """The actor class body (``RayWorker`` is ``ray.remote(RayWorkerBody)``)."""

    def __init__(self, config: EngineConfig, rank: int = 0, dist_init_method: str | None = None) -> None:
        self._config = config
        self._rank = rank
        self._worker: Worker | None = None
        self._channel: StepChannelServer | None = None
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

    def kv_tier_slots(self) -> int:
        return self._get().kv_tier_slots()

    def dtype_name(self) -> str:
        """The dtype this rank resolved (``dtype_choice``), e.g. "bfloat16"."""
        return self._get().dtype_choice.name

    def init_kv_cache(self, num_blocks: int) -> None:
        self._get().init_kv_cache(num_blocks)

    def execute(self, plan: StepPlan) -> StepResult | None:
        return self._get().execute(plan)

    def execute_bytes(self, data: bytes) -> bytes | None:
        return self._get().execute_bytes(data)

    def num_sequences(self) -> int:
        return self._get().num_sequences()

    def open_step_channel(self) -> tuple[str, int, bytes]:
        """Listens for the engine's step channel (step_channel.py): (host, port, secret) to connect to.
        Call ``serve_step_channel`` next; it answers the steps until the connection closes."""
        if self._channel is not None:
            raise RuntimeError(f"RayWorker rank {self._rank}: the step channel is already open")
        worker, host = self._get(), ray.util.get_node_ip_address()
        self._channel = StepChannelServer(host, worker.execute_bytes, worker.num_sequences)
        return host, self._channel.port, self._channel.secret

    def serve_step_channel(self) -> None:
        """Blocks this actor's main thread answering the step channel opened by ``open_step_channel``."""
        if self._channel is None:
            raise RuntimeError(f"RayWorker rank {self._rank}: call open_step_channel first")
        self._channel.serve()

    def process_id(self) -> int:
        """This rank's OS process id (the executor logs them at start-up: what a profiler or a fault test
        attaches to)."""
        return os.getpid()

    def ping(self) -> int:
        """Liveness only (reads no Worker state): the rank."""
        return self._rank

    def shutdown(self) -> None:
        if self._channel is not None:
            self._channel.close()
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None


RayWorker = ray.remote(RayWorkerBody)
