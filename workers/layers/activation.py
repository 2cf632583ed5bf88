"""Gated activations for the merged gate/up projection (elementwise: no communication).

``silu_and_mul``: ``kernels.silu_and_mul``, the fused Triton kernel on CUDA tensors, one C call
(``cpu_fused.c``: ``F.silu(gate) * up``'s arithmetic with its own exp, within an ulp or two) on CPU
tensors. ``gelu_tanh_and_mul`` (Gemma's ``gelu_pytorch_tanh``):
``F.gelu(gate, approximate="tanh") * up``, torch on every device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import kernels


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up [tokens, 2 * inter_local] (gate first, then up) -> [tokens, inter_local]
    return kernels.silu_and_mul(gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up [tokens, 2 * inter_local] (gate first, then up) -> [tokens, inter_local]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
