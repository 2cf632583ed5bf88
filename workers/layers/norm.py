"""RMSNorm with an optional fused residual add (replicated on every rank: no communication).

Numerics follow the reference implementation: normalise in float32, cast back to the input dtype,
then scale by the weight. ``forward(x, residual)`` returns ``(norm(x + residual), x + residual)``
so a decoder layer carries the residual stream without extra copies. The math runs in
``kernels.rms_norm``: the fused Triton kernel on CUDA tensors, the original torch code on CPU tensors
(``cpu_fused.c`` for hidden-size rows: the same arithmetic but for the order of the sum of squares;
the torch code for per-head rows). x is ``[tokens, size]`` or, for per-head q/k norm, ``[tokens, heads, size]``.
"""

from __future__ import annotations

import torch
from torch import nn

from ... import kernels
from ..weights.weight_loader import CheckpointReader, copy_into
from .linear import empty_param


class RMSNorm(nn.Module):
    """``weight_offset``: added to the checkpoint's weight at load, in float32 (Gemma stores w and scales by
    1 + w: with 1.0 the product is Gemma's, exactly so in float32)."""

    def __init__(self, size: int, eps: float, dtype, device, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.size = size
        self.eps = eps
        self.weight_offset = weight_offset
        self.weight = empty_param((size,), dtype, device)   # [size]

    def load(self, reader: CheckpointReader, name: str) -> None:
        value = reader.read(name, expect_shape=[self.size])
        if self.weight_offset:
            value = value.float() + self.weight_offset
        copy_into(self.weight, value, name)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, *, out: torch.Tensor | None = None):
        # x [tokens, size] or [tokens, heads, size]; ``out`` (x's shape, may be x) receives the normed rows
        return kernels.rms_norm(x, self.weight, self.eps, residual, out=out)
