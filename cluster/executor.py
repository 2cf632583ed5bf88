"""Executors: the one interface through which the engine runs a StepPlan on the TP workers.

- ``LocalExecutor``: one in-process ``Worker`` (tensor_parallel_size == 1): offline use, GPU benchmarks,
  tests. No serialization: the plan object is handed over directly.
- ``RayExecutor`` (``ray_executor.py``): one RayWorker actor per TP rank in a placement group.

``execute(plan)`` runs one step and returns its result. ``submit(plan)`` starts it and returns a
handle; ``wait(handle)`` returns its result. Steps run in submission order, so the engine's async scheduling
scheduling (``async_scheduling``) can queue step N+1 behind step N and wait for N.
``LocalExecutor`` runs submitted steps on one thread of its own (torch releases the GIL in its ops, so
the engine's thread schedules meanwhile); its ``execute`` stays on the caller's thread.

Every executor reports the ranks' dtype (``dtype``; the Ray executor refuses ranks that resolved
``auto`` differently) and decides the number of KV blocks at construction: the minimum of what each rank can
hold (``Worker.available_kv_blocks``), then initialises every rank's cache with it. The engine builds
its BlockManager with ``executor.num_blocks``.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch
from pagedray.workers.contract.config import EngineConfig
from pagedray.workers.contract.wire import StepPlan, StepResult
from pagedray.workers.worker import Worker

from .outputs import EngineDeadError


class Executor(Protocol):
    """Everything the engine calls on an executor."""

    num_blocks: int
    dtype: str          # the dtype every rank runs ("float32", "bfloat16", "float16")

    def execute(self, plan: StepPlan) -> StepResult: ...

    def submit(self, plan: StepPlan) -> object:
        """Starts ``plan`` after every step submitted before it; returns the handle for ``wait``."""
        ...

    def wait(self, handle: object) -> StepResult:
        """The result of a submitted step (raises what ``execute`` would)."""
        ...

    def check_health(self) -> None: ...

    def is_rank_failure(self, exc: BaseException) -> bool:
        """True when ``exc`` (raised by ``execute``) means a TP rank died and ``rebuild`` can cure it."""
        ...

    def rebuild(self) -> None:
        """Replaces the TP group after a rank failure (fresh ranks, empty KV caches)."""
        ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    """Runs the single TP rank in this process."""

    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size: LocalExecutor runs one rank, got "
                             f"{config.parallel.tensor_parallel_size}; use the Ray executor")
        self.worker = Worker(config, rank=0)
        self.dtype = self.worker.dtype_choice.name
        self.num_blocks = self.worker.available_kv_blocks()
        self.num_tier_slots = self.worker.kv_tier_slots()
        self.worker.init_kv_cache(self.num_blocks)
        self._closed = False
        self._step_thread: ThreadPoolExecutor | None = None   # created by the first submit

    def execute(self, plan: StepPlan) -> StepResult:
        if self._closed:
            raise EngineDeadError("the executor has been shut down")
        result = self.worker.execute(plan)
        if result is None:
            raise RuntimeError("rank 0 returned no StepResult")
        return result

    def submit(self, plan: StepPlan) -> Future:
        if self._closed:
            raise EngineDeadError("the executor has been shut down")
        if self._step_thread is None:
            self._step_thread = ThreadPoolExecutor(1, "pagedray-rank0", initializer=self._use_device)
        return self._step_thread.submit(self.execute, plan)

    def _use_device(self) -> None:
        if self.worker.device.type == "cuda":   # the current CUDA device is per thread
            torch.cuda.set_device(self.worker.device)

    def wait(self, handle: Future) -> StepResult:
        return handle.result()

    def check_health(self) -> None:
        if self._closed:
            raise EngineDeadError("the executor has been shut down")

    def is_rank_failure(self, exc: BaseException) -> bool:
        return False   # the rank is this process: nothing to rebuild

    def rebuild(self) -> None:
        raise RuntimeError("LocalExecutor runs its rank in this process; there is no TP group to rebuild")

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            if self._step_thread is not None:
                self._step_thread.shutdown(wait=True)   # a submitted step finishes before the worker goes
            self.worker.shutdown()


def create_executor(config: EngineConfig) -> Executor:
    if config.parallel.use_ray:
        from .ray_executor import RayExecutor

        return RayExecutor(config)
    return LocalExecutor(config)
