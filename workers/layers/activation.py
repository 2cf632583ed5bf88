"""SiLU-and-multiply for the merged gate/up projection (elementwise: no communication)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up [tokens, 2 * inter_local] (gate first, then up) -> [tokens, inter_local]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
