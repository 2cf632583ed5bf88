"""RMSNorm with an optional fused residual add (replicated on every rank: no communication).

Numerics follow the reference implementation: normalise in float32, cast back to the input dtype,
then scale by the weight. ``forward(x, residual)`` returns ``(norm(x + residual), x + residual)``
so a decoder layer carries the residual stream without extra copies.
"""

from __future__ import annotations

import torch
from torch import nn

from ..weight_loader import CheckpointReader, copy_into
from .linear import empty_param


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype, device) -> None:
        super().__init__()
        self.size = size
        self.eps = eps
        self.weight = empty_param((size,), dtype, device)   # [size]

    def load(self, reader: CheckpointReader, name: str) -> None:
        copy_into(self.weight, reader.read(name, expect_shape=[self.size]), name)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., size]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
