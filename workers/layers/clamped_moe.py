"""gpt-oss's mixture of experts: a router with a bias, softmax over the top-k logits, and experts with biases
whose SwiGLU is clamped (``layers/moe.py`` is the plain SiLU-gated kind).

Per token: ``logits = x W_r^T + b_r`` [E]; the ``top_k`` largest are softmaxed into the picks' weights (in x's
dtype, as transformers does). Per picked expert ``e`` (in ascending order, transformers' loop, so that float32
sums match it): ``gate_up = x @ W_gu[e] + b_gu[e]`` [2I] with gate and up **interleaved** (gate = even
columns, up = odd ones); ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``;
``h = (up + 1) * gate * sigmoid(alpha * gate)``; ``out = h @ W_d[e] + b_d[e]``, scaled by the pick's weight and
added into the token's row.

Checkpoint (transformers' layout, ``{block}.experts.*`` and ``{block}.router.*``): ``gate_up_proj`` [E, H, 2I],
``gate_up_proj_bias`` [E, 2I], ``down_proj`` [E, I, H], ``down_proj_bias`` [E, H], ``router.weight`` [E, H],
``router.bias`` [E]; or, in an MXFP4 checkpoint (``quant_method: mxfp4``), ``gate_up_proj_blocks`` /
``_scales`` and ``down_proj_blocks`` / ``_scales`` instead of the two weights, dequantized at load to the
compute dtype (``quantization.dequantize_mxfp4``; the packed 4-bit MoE kernel is not built yet, so a GPU holds
these experts in 16 bits too).

Tensor parallelism: every rank holds every expert's slice ``[start, end)`` of the intermediate dimension. In the
interleaved gate/up columns that slice is the contiguous ``[2 start, 2 end)``; down's rows ``[start, end)``. Each
rank's sum is a partial one completed by one all-reduce; the down bias (weighted by the pick) is added on rank 0
only, so it counts once.

The expert loop reads which experts were picked on the host (one sync per layer), so a model with these
experts runs its decode steps eagerly on CUDA (``graph_safe`` False: no CUDA graphs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..tp_group import TPGroup
from ..weights.quantization import dequantize_mxfp4
from ..weights.weight_loader import CheckpointReader, copy_into
from .linear import empty_param
from .moe import MoESpec
from .partition import check_even_split


class ClampedSwigluMoE(nn.Module):
    graph_safe = False      # the expert loop syncs with the host (module docstring)

    def __init__(self, hidden_size: int, spec: MoESpec, tp: TPGroup, dtype, device) -> None:
        super().__init__()
        if spec.swiglu_limit is None:
            raise ValueError("ClampedSwigluMoE: spec.swiglu_limit is required")
        self.spec, self.tp, self.checkpoint_name = spec, tp, spec.block
        rows = check_even_split(spec.intermediate_size, tp.world_size, "intermediate_size")
        self.start, self.rows, self.hidden_size = tp.rank * rows, rows, hidden_size
        experts = spec.num_experts
        self.router = empty_param((experts, hidden_size), dtype, device)                 # [E, H]
        self.router_bias = empty_param((experts,), dtype, device)                        # [E]
        self.gate_up = empty_param((experts, hidden_size, 2 * rows), dtype, device)      # [E, H, 2 I_local] interleaved
        self.gate_up_bias = empty_param((experts, 2 * rows), dtype, device)              # [E, 2 I_local]
        self.down = empty_param((experts, rows, hidden_size), dtype, device)             # [E, I_local, H]
        self.down_bias = empty_param((experts, hidden_size), dtype, device)              # [E, H]

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        e, h, full = self.spec.num_experts, self.hidden_size, self.spec.intermediate_size
        lo, hi = self.start, self.start + self.rows
        for param, name, shape in ((self.router, "router.weight", [e, h]), (self.router_bias, "router.bias", [e])):
            copy_into(param, reader.read(f"{prefix}.{name}", expect_shape=shape), f"{prefix}.{name}")
        base = f"{prefix}.experts"
        name = f"{base}.gate_up_proj_bias"
        copy_into(self.gate_up_bias, reader.read(name, expect_shape=[e, 2 * full])[:, 2 * lo:2 * hi], name)
        name = f"{base}.down_proj_bias"
        copy_into(self.down_bias, reader.read(name, expect_shape=[e, h]), name)
        for expert in range(e):                       # one expert at a time: MXFP4 dequantizes 8x its bytes
            gate_up = self._expert(reader, f"{base}.gate_up_proj", expert, [h, 2 * full])
            copy_into(self.gate_up[expert], gate_up[:, 2 * lo:2 * hi], f"{base}.gate_up_proj")
            down = self._expert(reader, f"{base}.down_proj", expert, [full, h])
            copy_into(self.down[expert], down[lo:hi], f"{base}.down_proj")

    def _expert(self, reader: CheckpointReader, name: str, expert: int, shape: list[int]) -> torch.Tensor:
        """Expert ``expert``'s whole weight [in, out] (``shape``), dequantized when the checkpoint holds MXFP4."""
        if not reader.has(name) and reader.has(f"{name}_blocks"):
            blocks = reader.read(f"{name}_blocks", 0, expert, expert + 1)[0]               # [out, in / 32, 16]
            scales = reader.read(f"{name}_scales", 0, expert, expert + 1)[0]               # [out, in / 32]
            weight = dequantize_mxfp4(blocks, scales, self.gate_up.dtype)                # [in, out]
        else:
            weight = reader.read(name, 0, expert, expert + 1)[0]
        if list(weight.shape) != shape:
            raise ValueError(f"model: expert {expert} of {name!r} has shape {list(weight.shape)}, expected {shape}")
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [tokens, H] -> [tokens, H] (all-reduced over the ranks)
        logits = F.linear(x, self.router, self.router_bias)                          # [tokens, E]
        top, experts = torch.topk(logits, self.spec.top_k, dim=-1)                    # [tokens, k]
        weights = torch.softmax(top, dim=-1, dtype=top.dtype)
        limit, alpha = self.spec.swiglu_limit, self.spec.swiglu_alpha
        out = torch.zeros_like(x)
        first_rank = self.tp.rank == 0
        for e in torch.unique(experts).tolist():
            token, slot = torch.where(experts == e)
            gate_up = x[token] @ self.gate_up[e] + self.gate_up_bias[e]              # [n, 2 I_local]
            gate = gate_up[:, ::2].clamp(max=limit)
            up = gate_up[:, 1::2].clamp(-limit, limit)
            y = ((up + 1) * (gate * torch.sigmoid(gate * alpha))) @ self.down[e]     # [n, H]
            if first_rank:
                y = y + self.down_bias[e]
            out.index_add_(0, token, y * weights[token, slot, None])
        self.tp.all_reduce(out)
        return out
