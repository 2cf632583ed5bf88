"""Gemma 4's routed experts (``enable_moe_block``): a router and stacked experts that run beside the layer's
dense MLP, on the residual stream the MLP reads (``models/gemma4_layers.py`` norms their inputs and outputs).

Router, per token, on the residual stream ``h`` [H] (transformers' order of ops, so float32 sums match):
``r = rms_norm(h) * scale * H^-0.5`` (a norm without weight, then the learned ``scale`` [H]); ``probs =
softmax(r W^T)`` in float32 over the ``E`` experts; the ``top_k`` largest, renormalised to sum to 1, each
multiplied by its expert's ``per_expert_scale``. Experts: ``kernels.fused_moe`` with the GELU-tanh gate on the
token's normed input (``pre_feedforward_layernorm_2``), the picks' weights cast to the hidden dtype (in float32,
transformers' own precision; in bfloat16 transformers keeps the weights in float32 and may round differently).

Checkpoint (transformers' layout, under the layer): ``router.proj.weight`` [E, H], ``router.scale`` [H],
``router.per_expert_scale`` [E], ``experts.gate_up_proj`` [E, 2I, H] (gate rows, then up) and
``experts.down_proj`` [E, H, I].

Tensor parallelism as ``layers/moe.py``: the router is replicated (every rank picks the same experts), every rank
holds every expert's slice ``[start, end)`` of the intermediate dimension, and one all-reduce completes the
experts' partial sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ... import kernels
from ..tp_group import TPGroup
from ..weights.weight_loader import CheckpointReader, copy_into
from .linear import empty_param
from .moe import MoESpec
from .partition import check_even_split


class Gemma4Experts(nn.Module):
    def __init__(self, hidden_size: int, spec: MoESpec, eps: float, tp: TPGroup, dtype, device) -> None:
        super().__init__()
        self.spec, self.tp, self.eps = spec, tp, eps
        rows = check_even_split(spec.intermediate_size, tp.world_size, "moe_intermediate_size")
        self.start, self.rows, self.hidden_size = tp.rank * rows, rows, hidden_size
        experts = spec.num_experts
        self.proj = empty_param((experts, hidden_size), dtype, device)                   # router [E, H]
        self.scale = empty_param((hidden_size,), dtype, device)                          # [H]
        self.per_expert_scale = empty_param((experts,), dtype, device)                   # [E]
        self.register_buffer("unit", torch.ones(hidden_size, dtype=dtype, device=device), persistent=False)
        self.gate_up = empty_param((experts, 2 * rows, hidden_size), dtype, device)     # [E, 2 I_local, H]
        self.down = empty_param((experts, hidden_size, rows), dtype, device)             # [E, H, I_local]

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        """``{prefix}.router.*`` and ``{prefix}.experts.*`` (this rank's rows / columns of every expert)."""
        e, h, full, lo, hi = self.spec.num_experts, self.hidden_size, self.spec.intermediate_size, self.start, \
            self.start + self.rows
        for param, name, shape in ((self.proj, "router.proj.weight", [e, h]), (self.scale, "router.scale", [h]),
                                   (self.per_expert_scale, "router.per_expert_scale", [e])):
            copy_into(param, reader.read(f"{prefix}.{name}", expect_shape=shape), f"{prefix}.{name}")
        name = f"{prefix}.experts.gate_up_proj"
        for half, offset in enumerate((0, full)):                       # gate rows, then up rows
            copy_into(self.gate_up[:, half * self.rows:(half + 1) * self.rows],
                      reader.read(name, 1, offset + lo, offset + hi, expect_shape=[e, 2 * full, h]), name)
        name = f"{prefix}.experts.down_proj"
        for expert in range(e):                                         # one expert at a time, its columns
            value = reader.read(name, 0, expert, expert + 1, expect_shape=[e, h, full])[0]
            copy_into(self.down[expert], value[:, lo:hi], name)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # h [T, H] (the residual stream) -> (weights [T, k] in h's dtype, expert ids [T, k])
        r = kernels.rms_norm(h, self.unit, self.eps) * self.scale * self.hidden_size ** -0.5
        probs = F.softmax(F.linear(r, self.proj), dim=-1, dtype=torch.float32)          # [T, E]
        weights, experts = torch.topk(probs, self.spec.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.per_expert_scale[experts]
        return weights.to(h.dtype), experts

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # h [T, H] routes, x [T, H] (h normed for the experts) goes through them -> [T, H] (all-reduced)
        weights, experts = self.route(h)
        out = kernels.fused_moe(x, self.gate_up, self.down, weights, experts, activation="gelu_tanh")
        return self.tp.all_reduce(out)
