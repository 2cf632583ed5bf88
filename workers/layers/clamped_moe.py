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
compute dtype on CPU (``quantization.dequantize_mxfp4``); on CUDA kept in 4 bits (``_read_mxfp4``: the
checkpoint's e2m1 codes and power-of-two scales repacked for the packed grouped GEMM, float4 ``PackedExperts``)
unless this rank's slice of the intermediate dimension does not lie on groups of 32 (then dequantized to 16
bits).

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
from ...kernels.quant_gemm import PackedExperts
from ..tp_group import TPGroup
from ..weights.quantization import MXFP4_GROUP, dequantize_mxfp4, mxfp4_to_packed_rows
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
        self.device = device
        self.packed: tuple[PackedExperts, PackedExperts] | None = None   # (gate_up, down) kept in MXFP4 (CUDA)
        if self.fused:                                         # allocated at load unless kept packed
            meta = torch.device("meta")
            self.gate_up = empty_param((experts, 2 * rows, hidden_size), dtype, meta)    # [E, 2 I_local, H] gates first
            self.down = empty_param((experts, hidden_size, rows), dtype, meta)           # [E, H, I_local]
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
        if self.fused and reader.has(f"{base}.gate_up_proj_blocks") and lo % MXFP4_GROUP == 0 \
                and self.rows % MXFP4_GROUP == 0:
            self.packed = self._read_mxfp4(reader, base)
            self.gate_up = self.down = None
            return
        if self.gate_up.is_meta:
            self.gate_up = empty_param(tuple(self.gate_up.shape), self.gate_up.dtype, self.device)
            self.down = empty_param(tuple(self.down.shape), self.down.dtype, self.device)
        for expert in range(e):                       # one expert at a time: MXFP4 dequantizes 8x its bytes
            gate_up = self._expert(reader, f"{base}.gate_up_proj", expert, [h, 2 * full])[:, 2 * lo:2 * hi]
            down = self._expert(reader, f"{base}.down_proj", expert, [full, h])[lo:hi]           # [I_local, H]
            if self.fused:
                gate_up, down = _gates_first(gate_up).T, down.T              # [2 I_local, H], [H, I_local]
            copy_into(self.gate_up[expert], gate_up, f"{base}.gate_up_proj")
            copy_into(self.down[expert], down, f"{base}.down_proj")

    def _read_mxfp4(self, reader: CheckpointReader, base: str) -> tuple[PackedExperts, PackedExperts]:
        """The MXFP4 experts kept in 4 bits (the fused layout on CUDA): this rank's gate rows then up rows of each
        ``gate_up_proj`` (all of H as inputs) and its input slice of each ``down_proj``, the checkpoint's codes and
        scales repacked as ``kernels.quant_gemm``'s e2m1 ``PackedExperts`` (groups of 32)."""
        e, h, full = self.spec.num_experts, self.hidden_size, self.spec.intermediate_size
        lo, hi = self.start, self.start + self.rows
        gates = torch.arange(2 * lo, 2 * hi, 2)
        picks = (("gate_up_proj", [2 * full, h // MXFP4_GROUP, 16], torch.cat([gates, gates + 1]), slice(0, h)),
                 ("down_proj", [h, full // MXFP4_GROUP, 16], slice(None), slice(lo, hi)))
        packed = []
        for proj, shape, rows, inputs in picks:
            name = f"{base}.{proj}"
            words, scales = [], []
            for expert in range(e):
                blocks = reader.read(f"{name}_blocks", 0, expert, expert + 1)[0]            # [out, in / 32, 16]
                exponents = reader.read(f"{name}_scales", 0, expert, expert + 1)[0]         # [out, in / 32]
                if list(blocks.shape) != shape or list(exponents.shape) != shape[:2]:
                    raise ValueError(f"model: expert {expert} of {name!r} has MXFP4 blocks {list(blocks.shape)} / "
                                     f"scales {list(exponents.shape)}, expected {shape} / {shape[:2]}")
                qweight, scale = mxfp4_to_packed_rows(blocks, exponents, rows, inputs)    # [K / 8, N], [K / 32, N]
                words.append(qweight)
                scales.append(scale)
            k = words[0].shape[0] * 8
            scales = torch.stack(scales).to(self.device)                                     # [E, K / 32, N] float32
            packed.append(PackedExperts(torch.stack(words).to(self.device),
                                        torch.zeros(scales.shape, dtype=torch.int32, device=self.device), scales,
                                        (torch.arange(k) // MXFP4_GROUP).to(torch.int32).to(self.device), 4,
                                        MXFP4_GROUP, float4=True))
        return packed[0], packed[1]

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
            gate_up, down = self.packed or (self.gate_up, self.down)
            out = kernels.fused_moe(x, gate_up, down, weights, experts, activation=self.act,
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
