"""SiLU-and-multiply for the merged gate/up projection (elementwise: no communication).

``kernels.silu_and_mul``: the fused Triton kernel on CUDA tensors, ``F.silu(gate) * up`` (the original
code, bit-identical) on CPU tensors.
"""

from __future__ import annotations

import torch

from ... import kernels


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up [tokens, 2 * inter_local] (gate first, then up) -> [tokens, inter_local]
    return kernels.silu_and_mul(gate_up)
