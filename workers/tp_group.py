"""The tensor-parallel process group of one worker, and the only place that talks to torch.distributed.

A ``TPGroup`` is created once per worker and handed to every parallel layer as a constructor
argument (no global "current group"). Layers call its collectives explicitly in their ``forward``
so the communication of a step can be read off the layer code:

- ``all_reduce``: sum over ranks, in place (row-parallel linear, vocab-parallel embedding).
- ``gather_to_first``: concatenate per-rank shards along the last dim on rank 0 only (LM head);
  other ranks get None.
- ``broadcast_from_first``: rank 0's tensor on every rank (the draft model's tokens: ``draft_model.py``).

With one rank every collective is the identity and torch.distributed is never initialised.
Backend: gloo on CPU, NCCL on CUDA (``backend_for``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class TPGroup:
    """One rank's view of the tensor-parallel group.

    Invariant: ``0 <= rank < world_size``; when ``world_size > 1`` the default torch.distributed
    group exists and contains exactly the TP ranks of this model replica.
    """

    def __init__(self, rank: int, world_size: int, device: torch.device, owns_process_group: bool) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self._owns_process_group = owns_process_group

    @classmethod
    def single(cls, device: torch.device) -> TPGroup:
        return cls(rank=0, world_size=1, device=device, owns_process_group=False)

    @classmethod
    def join(cls, rank: int, world_size: int, device: torch.device, init_method: str | None) -> TPGroup:
        """Join (and, on rank 0, host) the process group; blocks until every rank has joined."""
        if world_size == 1:
            return cls.single(device)
        if not init_method:
            raise ValueError("dist_init_method: required when tensor_parallel_size > 1 "
                             "(e.g. 'tcp://10.0.0.1:29500', see RayWorker.node_ip_and_free_port)")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: must be in [0, {world_size}), got {rank}")
        dist.init_process_group(backend=backend_for(device), init_method=init_method,
                                rank=rank, world_size=world_size)
        return cls(rank=rank, world_size=world_size, device=device, owns_process_group=True)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over ranks in place and return it."""
        if self.world_size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [..., n] on every rank (same shape) -> [..., world_size * n] on rank 0, None elsewhere."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_first else None
        dist.gather(x, gather_list=parts, dst=0)
        return torch.cat(parts, dim=-1) if self.is_first else None

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank (in place; the others pass a tensor of the same shape and dtype)."""
        if self.world_size > 1:
            dist.broadcast(x, src=0)
        return x

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def destroy(self) -> None:
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_process_group = False
