"""Tensor parallelism over threads of one process: the ranks of a TP group as ``Worker`` objects whose
``TPGroup`` exchanges tensors through shared memory at a barrier, instead of Ray actors joined by gloo.

For tests that must change what every rank does (``monkeypatch`` reaches this process's threads, not a Ray
actor's process), e.g. keeping quantized weights packed on CPU as CUDA does. The collectives mean what
``TPGroup``'s mean: ``all_reduce`` adds the ranks' tensors in rank order (for two ranks the same sum gloo
gives, as float addition of two terms does not depend on their order), ``gather_to_first`` concatenates on
rank 0, ``broadcast_from_first`` copies rank 0's tensor. A rank that raises breaks the barrier, so the other
ranks stop with ``BrokenBarrierError`` instead of waiting for it.
"""

from __future__ import annotations

import threading

import torch
from pagedray.workers import worker as worker_module
from pagedray.workers.tp_group import TPGroup

from helpers.worker_plans import PlanDriver
from helpers.worker_setup import engine_config


class ThreadExchange:
    """What the ranks of one group share: a slot per rank and the barrier they meet at."""

    def __init__(self, world_size: int) -> None:
        self.slots: list[torch.Tensor | None] = [None] * world_size
        self.barrier = threading.Barrier(world_size)


class ThreadTPGroup(TPGroup):
    def __init__(self, rank: int, world_size: int, device: torch.device, exchange: ThreadExchange) -> None:
        super().__init__(rank, world_size, device, owns_process_group=False)
        self.exchange = exchange

    def _every_ranks(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each rank's copy of ``x``, in rank order (every rank has read them before any rank goes on)."""
        self.exchange.slots[self.rank] = x.detach().clone()
        self.exchange.barrier.wait()
        parts = list(self.exchange.slots)
        self.exchange.barrier.wait()
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._every_ranks(x)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return x.copy_(total)

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        parts = self._every_ranks(x.contiguous())
        return torch.cat(parts, dim=-1) if self.is_first else None

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        return x.copy_(self._every_ranks(x)[0])


def thread_tp_workers(monkeypatch, model_path: str, tp: int, num_blocks: int = 64, block_size: int = 8,
                      **model_kwargs) -> list[worker_module.Worker]:
    """``tp`` workers of one model, rank r holding its shard as a Ray worker of that rank would, joined by a
    ``ThreadTPGroup``; KV caches allocated."""
    exchange = ThreadExchange(tp)
    monkeypatch.setattr(worker_module.TPGroup, "join",
                        lambda rank, world_size, device, init_method: ThreadTPGroup(rank, world_size, device, exchange))
    config = engine_config(model_path, tp=tp, num_blocks=num_blocks, block_size=block_size, **model_kwargs)
    workers = [worker_module.Worker(config, rank) for rank in range(tp)]
    for worker in workers:
        worker.init_kv_cache(num_blocks)
    return workers


def run_on_ranks(workers: list[worker_module.Worker], plan):
    """``plan`` on every rank at once (a thread each, joined before returning); rank 0's result."""
    exchange = workers[0].tp.exchange
    results: list = [None] * len(workers)
    errors: list[BaseException | None] = [None] * len(workers)

    def run_rank(rank: int) -> None:
        try:
            results[rank] = workers[rank].execute(plan)
        except BaseException as exc:   # noqa: BLE001 - handed to the caller below
            errors[rank] = exc
            exchange.barrier.abort()   # the other ranks stop at their next collective instead of waiting

    threads = [threading.Thread(target=run_rank, args=(rank,), name=f"tp-rank-{rank}")
               for rank in range(len(workers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failed = [e for e in errors if e is not None]
    if failed:   # the rank that failed, not the peers whose barrier it broke
        raise next((e for e in failed if not isinstance(e, threading.BrokenBarrierError)), failed[0])
    assert all(result is None for result in results[1:]), "only rank 0 may return a result"
    return results[0]


def thread_tp_driver(workers: list[worker_module.Worker], block_size: int = 8, num_blocks: int = 64,
                     **driver_kwargs) -> PlanDriver:
    """A plan driver whose every step runs on all ranks at once (``run_on_ranks``)."""
    return PlanDriver(lambda plan: run_on_ranks(workers, plan), block_size, num_blocks, **driver_kwargs)


class ThreadTPExecutor:
    """An engine executor (``cluster.executor.Executor``) over ``thread_tp_workers``: the whole engine path at
    TP > 1 in one process, without Ray."""

    def __init__(self, workers: list[worker_module.Worker], num_blocks: int) -> None:
        self.workers, self.num_blocks = workers, num_blocks
        self.num_tier_slots = min(worker.kv_tier_slots() for worker in workers)
        self.dtype = workers[0].dtype_choice.name

    def execute(self, plan):
        return run_on_ranks(self.workers, plan)

    def submit(self, plan):
        return self.execute(plan)

    def wait(self, handle):
        return handle

    def check_health(self) -> None:
        pass

    def is_rank_failure(self, exc: BaseException) -> bool:
        return False

    def rebuild(self) -> None:
        raise RuntimeError("ThreadTPExecutor: no rank ever fails")

    def shutdown(self) -> None:
        pass
