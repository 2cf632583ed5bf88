"""Gemma 4's attention and decoder layer (``models/gemma4.py`` stacks them; ``gemma4_config.py`` plans them).

Attention, per layer and rank (``LayerPlan``: its head shape, window, ``k_eq_v``, ``kv_source``):

- one column-parallel projection of this rank's heads: q, k and v (``k_eq_v``: q and k, the values being the key
  projection); a KV-shared layer projects q only;
- q and k RMS-normed per head with their weights (Gemma 4's norms scale by ``w``, not ``1 + w``), v normed without
  one; rope (this layer kind's ``cos_sin``) on q and k; the softmax scale is 1 (the norms set the scale);
- paged attention over this rank's KV heads: a layer with its own KV stores it first
  (``PagedAttention``); a KV-shared layer stores nothing and reads its source layer's cache rows, which the source
  wrote earlier in the same forward (``kernels.paged_attention``), within its own window;
- ``o_proj`` row-parallel (one all-reduce).

Decoder layer (transformers' order; every norm is applied before its residual add, so none fuses with it):
``h += post_attention_layernorm(attn(input_layernorm(h)))``; ``m = mlp(pre_feedforward_layernorm(h))`` (GELU-tanh);
with the MoE block ``m = post_feedforward_layernorm_1(m) + post_feedforward_layernorm_2(experts(h,
pre_feedforward_layernorm_2(h)))``; ``h += post_feedforward_layernorm(m)``; with per-layer inputs ``h +=
post_per_layer_input_norm(per_layer_projection(gelu_tanh(per_layer_input_gate(h)) * ple))`` (both projections
replicated on every rank: small, and no collective); finally ``h *= layer_scalar`` (a checkpoint value).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ... import kernels
from ..layers.attention import AttentionMetadata, PagedAttention
from ..layers.gemma4_moe import Gemma4Experts
from ..layers.linear import ColumnParallelLinear, RowParallelLinear, Segment
from ..layers.moe import MoESpec
from ..layers.norm import RMSNorm
from ..layers.partition import HeadPartition
from ..layers.rotary import apply_rotary
from ..tp_group import TPGroup
from ..weights.weight_loader import CheckpointReader, copy_into
from .decoder import ArchSpec, DecoderMLP, ModelDims
from .gemma4_config import LayerPlan


class Gemma4Attention(nn.Module):
    def __init__(self, plan: LayerPlan, dims: ModelDims, bias: bool, tp: TPGroup, dtype, device) -> None:
        super().__init__()
        heads = HeadPartition(dims.num_heads, plan.num_kv_heads, tp.world_size, tp.rank)
        d = self.head_dim = plan.head_dim
        self.num_heads, self.num_kv_heads = heads.num_local_heads, heads.num_local_kv_heads
        self.shared, self.k_eq_v = plan.kv_source is not None, plan.k_eq_v
        q = Segment(dims.num_heads * d, heads.first_head * d, self.num_heads * d)
        kv = Segment(plan.num_kv_heads * d, heads.first_kv_head * d, self.num_kv_heads * d)
        self.projections = ["q_proj"] + ([] if self.shared else ["k_proj"] if self.k_eq_v else ["k_proj", "v_proj"])
        segments = [q] + [kv] * (len(self.projections) - 1)
        self.qkv_proj = ColumnParallelLinear(dims.hidden_size, segments, bias, dtype, device)
        self.o_proj = RowParallelLinear(dims.num_heads * d, dims.hidden_size, bias, tp, dtype, device,
                                        name="num_attention_heads * head_dim")
        eps = dims.rms_norm_eps
        self.q_norm = RMSNorm(d, eps, dtype, device)
        self.k_norm = None if self.shared else RMSNorm(d, eps, dtype, device)
        self.register_buffer("unit", torch.ones(d, dtype=dtype, device=device), persistent=False)   # v_norm
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, 1.0, sliding_window=plan.window)

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        self.qkv_proj.load(reader, [f"{prefix}.{name}" for name in self.projections])
        self.o_proj.load(reader, f"{prefix}.o_proj")
        self.q_norm.load(reader, f"{prefix}.q_norm.weight")
        if self.k_norm is not None:
            self.k_norm.load(reader, f"{prefix}.k_norm.weight")

    def forward(self, hidden, cos_sin, kv_layer, meta: AttentionMetadata) -> torch.Tensor:
        # hidden [T, hidden] -> [T, hidden]; cos_sin: this layer kind's [T, 1, head_dim] tables
        tokens, d, h, hk = hidden.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(hidden)                                              # [T, (h + (1|2) hk) * d]
        q = apply_rotary(self.q_norm(qkv[:, :h * d].view(tokens, h, d)), *cos_sin)            # [T, h, d]
        if self.shared:
            out = kernels.paged_attention(q, kv_layer.k, kv_layer.v, meta.cu_seqlens_q, meta.seq_lens_k,
                                          meta.block_tables, 1.0, max_query_len=meta.max_query_len,
                                          sliding_window=self.attn.sliding_window, validate_values=False,
                                          k_scale=kv_layer.k_scale, v_scale=kv_layer.v_scale)
        else:
            k = qkv[:, h * d:(h + hk) * d].view(tokens, hk, d)
            v = k if self.k_eq_v else qkv[:, (h + hk) * d:].view(tokens, hk, d)
            v = kernels.rms_norm(v, self.unit, self.q_norm.eps)
            out = self.attn(q, apply_rotary(self.k_norm(k), *cos_sin), v, kv_layer, meta)
        return self.o_proj(out.reshape(tokens, h * d))


class Gemma4Layer(nn.Module):
    NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    MOE_NORMS = ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2")

    def __init__(self, plan: LayerPlan, dims: ModelDims, bias: bool, moe: MoESpec | None, ple_size: int,
                 tp: TPGroup, dtype, device) -> None:
        super().__init__()
        self.kind = plan.kind
        hidden, eps = dims.hidden_size, dims.rms_norm_eps
        self.norm_names = self.NORMS + (self.MOE_NORMS if moe is not None else ())
        self.norms = nn.ModuleDict({name: RMSNorm(hidden, eps, dtype, device) for name in self.norm_names})
        self.self_attn = Gemma4Attention(plan, dims, bias, tp, dtype, device)
        self.mlp = DecoderMLP(replace(dims, intermediate_size=plan.intermediate_size), ArchSpec(gelu_tanh=True), tp,
                              dtype, device)
        self.experts = None if moe is None else Gemma4Experts(hidden, moe, eps, tp, dtype, device)
        self.ple_gate = self.ple_proj = self.ple_norm = None
        if ple_size:
            self.ple_gate = ColumnParallelLinear.replicated(hidden, ple_size, False, dtype, device)
            self.ple_proj = ColumnParallelLinear.replicated(ple_size, hidden, False, dtype, device)
            self.ple_norm = RMSNorm(hidden, eps, dtype, device)
        self.register_buffer("layer_scalar", torch.empty(1, dtype=dtype, device=device))      # [1]

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        for name in self.norm_names:
            self.norms[name].load(reader, f"{prefix}.{name}.weight")
        self.self_attn.load(reader, f"{prefix}.self_attn")
        self.mlp.load(reader, f"{prefix}.mlp")
        if self.experts is not None:
            self.experts.load(reader, prefix)
        if self.ple_gate is not None:
            self.ple_gate.load(reader, [f"{prefix}.per_layer_input_gate"])
            self.ple_proj.load(reader, [f"{prefix}.per_layer_projection"])
            self.ple_norm.load(reader, f"{prefix}.post_per_layer_input_norm.weight")
        name = f"{prefix}.layer_scalar"
        copy_into(self.layer_scalar, reader.read(name, expect_shape=[1]), name)

    def forward(self, hidden, ple, cos_sin, kv_layer, meta: AttentionMetadata) -> torch.Tensor:
        # hidden [T, H] (the residual stream); ple [T, ple_size] this layer's per-layer input, or None
        norm = self.norms
        hidden = hidden + norm["post_attention_layernorm"](self.self_attn(norm["input_layernorm"](hidden), cos_sin,
                                                                          kv_layer, meta))
        mlp = self.mlp(norm["pre_feedforward_layernorm"](hidden))
        if self.experts is not None:
            routed = self.experts(hidden, norm["pre_feedforward_layernorm_2"](hidden))
            mlp = norm["post_feedforward_layernorm_1"](mlp) + norm["post_feedforward_layernorm_2"](routed)
        hidden = hidden + norm["post_feedforward_layernorm"](mlp)
        if self.ple_gate is not None:
            gated = F.gelu(self.ple_gate(hidden), approximate="tanh") * ple                      # [T, ple_size]
            hidden = hidden + self.ple_norm(self.ple_proj(gated))
        return hidden * self.layer_scalar
