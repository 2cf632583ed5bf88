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
compute dtype (``quantization.dequantize_mxfp4``; a GPU holds these experts in 16 bits too: no 4-bit MXFP4
expert kernel yet).

Tensor parallelism: every rank holds every expert's slice ``[start, end)`` of the intermediate dimension. In the
interleaved gate/up columns that slice is the contiguous ``[2 start, 2 end)``; down's rows ``[start, end)``. Each
rank's sum is a partial one completed by one all-reduce; the down bias (weighted by the pick) is added on rank 0
only, so it counts once.

Two layouts, chosen at construction by where the kernels run (``kernels.fused_triton_path``):

- CPU: the checkpoint's (``gate_up`` [E, H, 2I_local] interleaved, ``down`` [E, I_local, H]) and the loop over
  the picked experts above, which reads the picks on the host (the float32 sums in transformers' order);
- CUDA: ``kernels.fused_moe``'s (``gate_up`` [E, 2I_local, H] with the gate rows first, then the up rows, the
  bias likewise; ``down`` [E, H, I_local]), rearranged expert by expert at load, and one call of its grouped
  Triton GEMMs with the biases and ``ClampedSwiglu`` as the activation: no host reads, so decode steps are
  captured in CUDA graphs (``graph_safe``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ... import kernels
from ...kernels import ClampedSwiglu, fused_triton_path
from ..tp_group import TPGroup
from ..weights.quantization import dequantize_mxfp4
from ..weights.weight_loader import CheckpointReader, copy_into
from .linear import empty_param
from .moe import MoESpec
from .partition import check_even_split


def _gates_first(interleaved: torch.Tensor) -> torch.Tensor:
    # [..., 2I] with gate = even columns, up = odd ones -> [..., 2I] with the I gates first, then the I ups
    return torch.cat([interleaved[..., 0::2], interleaved[..., 1::2]], dim=-1)


class ClampedSwigluMoE(nn.Module):
    use_triton: bool | None = None   # the fused layout's kernels.fused_moe dispatch (None: Triton on CUDA)

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
        self.fused = fused_triton_path(device)                 # the layout (module docstring)
        if self.fused:
            self.gate_up = empty_param((experts, 2 * rows, hidden_size), dtype, device)  # [E, 2 I_local, H] gates first
            self.down = empty_param((experts, hidden_size, rows), dtype, device)         # [E, H, I_local]
        else:
            self.gate_up = empty_param((experts, hidden_size, 2 * rows), dtype, device)  # [E, H, 2 I_local] interleaved
            self.down = empty_param((experts, rows, hidden_size), dtype, device)         # [E, I_local, H]
        self.gate_up_bias = empty_param((experts, 2 * rows), dtype, device)              # [E, 2 I_local], as gate_up
        self.down_bias = empty_param((experts, hidden_size), dtype, device)              # [E, H]
        self.act = ClampedSwiglu(spec.swiglu_limit, spec.swiglu_alpha)

    @property
    def graph_safe(self) -> bool:
        """Only the fused layout's decode steps read nothing on the host (module docstring)."""
        return self.fused

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        e, h, full = self.spec.num_experts, self.hidden_size, self.spec.intermediate_size
        lo, hi = self.start, self.start + self.rows
        for param, name, shape in ((self.router, "router.weight", [e, h]), (self.router_bias, "router.bias", [e])):
            copy_into(param, reader.read(f"{prefix}.{name}", expect_shape=shape), f"{prefix}.{name}")
        base = f"{prefix}.experts"
        name = f"{base}.gate_up_proj_bias"
        bias = reader.read(name, expect_shape=[e, 2 * full])[:, 2 * lo:2 * hi]                 # [E, 2 I_local]
        copy_into(self.gate_up_bias, _gates_first(bias) if self.fused else bias, name)
        name = f"{base}.down_proj_bias"
        copy_into(self.down_bias, reader.read(name, expect_shape=[e, h]), name)
        for expert in range(e):                       # one expert at a time: MXFP4 dequantizes 8x its bytes
            gate_up = self._expert(reader, f"{base}.gate_up_proj", expert, [h, 2 * full])[:, 2 * lo:2 * hi]
            down = self._expert(reader, f"{base}.down_proj", expert, [full, h])[lo:hi]           # [I_local, H]
            if self.fused:
                gate_up, down = _gates_first(gate_up).T, down.T              # [2 I_local, H], [H, I_local]
            copy_into(self.gate_up[expert], gate_up, f"{base}.gate_up_proj")
            copy_into(self.down[expert], down, f"{base}.down_proj")

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
        first_rank = self.tp.rank == 0
        if self.fused:
            out = kernels.fused_moe(x, self.gate_up, self.down, weights, experts, activation=self.act,
                                    gate_up_bias=self.gate_up_bias, down_bias=self.down_bias if first_rank else None,
                                    use_triton=self.use_triton)
            self.tp.all_reduce(out)
            return out
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():
            token, slot = torch.where(experts == e)
            gate_up = x[token] @ self.gate_up[e] + self.gate_up_bias[e]              # [n, 2 I_local]
            y = self.act(gate_up[:, ::2], gate_up[:, 1::2]) @ self.down[e]           # [n, H]
            if first_rank:
                y = y + self.down_bias[e]
            out.index_add_(0, token, y * weights[token, slot, None])
        self.tp.all_reduce(out)
        return out
