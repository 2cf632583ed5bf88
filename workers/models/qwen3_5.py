"""Qwen3.5 / Qwen3.6 text models (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``): hybrid attention.

``layer_types`` mixes ``linear_attention`` layers (Gated DeltaNet, ``layers/gated_delta_net.py``: a recurrent
state per sequence instead of a KV cache) and ``full_attention`` layers (one in four by default), which are
Qwen3's attention with

- a gate: ``q_proj`` writes, per head, the query's ``head_dim`` rows then a gate's; the attention output is
  multiplied by ``sigmoid(gate)`` before ``o_proj``;
- q/k RMSNorm scaling by ``1 + w`` (as every norm of these models), partial rotary (``partial_rotary_factor``:
  the first ``head_dim * factor`` dimensions of each head rotate; text positions make the multimodal rope
  the plain one).

The MLP is SiLU-gated (dense), or for the MoE models a sparse MoE with a gated shared expert on every layer
(``layers/moe.py``, experts renormalised). Only the full-attention layers hold KV blocks (``num_kv_layers``);
the linear layers' state pool (``allocate_states``: one slot per sequence the scheduler may run, one per
prefix-cache snapshot, plus a scratch slot) is allocated next to the weights, before the KV cache is sized. Which
slot a sequence uses comes with the step (``AttentionMetadata.state_slots``, handed out by the block manager's
state pool), and so do the snapshots the step takes (``AttentionMetadata.state_snapshots``).

Not supported (refused before any weight is read, naming the field): another ``layer_types`` kind, an
activation other than SiLU, attention biases. The multimodal checkpoints (``Qwen3_5ForConditionalGeneration``,
``Qwen3_5MoeForConditionalGeneration``) load as text models: their ``text_config`` and the
``model.language_model.*`` tensors (model_info.load_hf_config); the vision tower is not loaded.
CUDA graphs (``workers/runner/decode_graphs.py``): a decode-only step reads nothing on the host on CUDA (its
slots, fresh flags and the recurrent Triton kernel stay on the device; bucket padding rows share the scratch
slot, whose contents nobody reads), so the dense and MoE hybrids capture their decode steps like the dense
families (``graph_safe``). Steps with prompt tokens read their spans on the host and run eagerly, as do decode
steps that take a prefix-cache snapshot (``ModelRunner.prepare``). On CPU a decode step reads its slots on the
host (an in-place slot range; ``decode_reads_host``).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..kv_cache import KVCache
from ..layers.attention import AttentionMetadata, PagedAttention
from ..layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ..layers.gated_delta_net import GatedDeltaNet, LinearDims, StateStep
from ..layers.linear import ColumnParallelLinear, RowParallelLinear, Segment
from ..layers.moe import MoESpec, SparseMoE
from ..layers.norm import RMSNorm
from ..layers.partition import HeadPartition, check_even_split, check_head_split
from ..layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from ..tp_group import TPGroup
from ..weights.weight_loader import CheckpointReader
from .decoder import ArchSpec, DecoderMLP, ModelDims, load_decoder_weights

LINEAR, FULL = "linear_attention", "full_attention"


def _dims(cfg) -> ModelDims:
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"model: hidden_act {cfg.hidden_act!r} is not supported (only 'silu')")
    if getattr(cfg, "attention_bias", False):
        raise ValueError("model: attention_bias is not supported on this architecture")
    inter = getattr(cfg, "intermediate_size", None) or getattr(cfg, "shared_expert_intermediate_size", 0)
    return ModelDims(cfg.vocab_size, cfg.hidden_size, inter, cfg.num_hidden_layers, cfg.num_attention_heads,
                     cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps, bool(cfg.tie_word_embeddings))


def _layer_types(cfg) -> list[str]:
    types = list(cfg.layer_types)
    unknown = sorted(set(types) - {LINEAR, FULL})
    if unknown or len(types) != cfg.num_hidden_layers:
        raise ValueError(f"model: layer_types must list {cfg.num_hidden_layers} of {LINEAR!r} / {FULL!r}, got "
                         f"{unknown or len(types)}")
    return types


def _rope(cfg) -> tuple[int, dict]:
    """(rotary dimensions per head, rope settings for them)."""
    params = rope_parameters(cfg)
    factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) or 1.0
    dims = int(cfg.head_dim * factor)
    if dims <= 0 or dims % 2 or dims > cfg.head_dim:
        raise ValueError(f"model: partial_rotary_factor {factor} gives {dims} rotary dimensions of head_dim "
                         f"{cfg.head_dim} (need an even number in [2, head_dim])")
    return dims, params


def _moe(cfg) -> MoESpec | None:
    experts = getattr(cfg, "num_experts", None)
    if not experts:
        return None
    top_k = cfg.num_experts_per_tok
    if not 0 < top_k <= experts:
        raise ValueError(f"model: num_experts_per_tok {top_k} of {experts} experts is not a valid routing")
    return MoESpec(experts, top_k, cfg.moe_intermediate_size, norm_topk_prob=True,
                   shared_intermediate_size=getattr(cfg, "shared_expert_intermediate_size", 0) or 0)


class GatedAttention(nn.Module):
    """Full attention with an output gate and partial rotary (module docstring)."""

    def __init__(self, dims: ModelDims, rotary_dims: int, tp: TPGroup, dtype, device) -> None:
        super().__init__()
        heads = HeadPartition(dims.num_heads, dims.num_kv_heads, tp.world_size, tp.rank)
        d = self.head_dim = dims.head_dim
        self.num_heads, self.num_kv_heads = heads.num_local_heads, heads.num_local_kv_heads
        self.rotary_dims = rotary_dims
        # q_proj's rows: per head, the query's then the gate's
        q = Segment(dims.num_heads * 2 * d, heads.first_head * 2 * d, self.num_heads * 2 * d)
        kv = Segment(dims.num_kv_heads * d, heads.first_kv_head * d, self.num_kv_heads * d)
        self.qkv_proj = ColumnParallelLinear(dims.hidden_size, [q, kv, kv], False, dtype, device)
        self.o_proj = RowParallelLinear(dims.num_heads * d, dims.hidden_size, False, tp, dtype, device,
                                        name="num_attention_heads * head_dim")
        self.q_norm = RMSNorm(d, dims.rms_norm_eps, dtype, device, 1.0)
        self.k_norm = RMSNorm(d, dims.rms_norm_eps, dtype, device, 1.0)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, d ** -0.5)

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        self.qkv_proj.load(reader, [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"])
        self.o_proj.load(reader, f"{prefix}.o_proj")
        self.q_norm.load(reader, f"{prefix}.q_norm.weight")
        self.k_norm.load(reader, f"{prefix}.k_norm.weight")

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [T, heads, D]: the first rotary_dims of each head rotated, the rest passed through
        r = self.rotary_dims
        if r == self.head_dim:
            return apply_rotary(x, cos, sin)
        return torch.cat([apply_rotary(x[..., :r].contiguous(), cos, sin), x[..., r:]], dim=-1)

    def forward(self, hidden, cos_sin, kv_layer, meta: AttentionMetadata) -> torch.Tensor:
        # hidden [T, hidden] -> [T, hidden]
        tokens, d, h, hk = hidden.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(hidden)
        qg, k, v = qkv.split([h * 2 * d, hk * d, hk * d], dim=-1)
        q, gate = qg.view(tokens, h, 2 * d).split([d, d], dim=-1)                     # [T, h, D] each
        q = self._rotate(self.q_norm(q.contiguous()), *cos_sin)
        k = self._rotate(self.k_norm(k.reshape(tokens, hk, d)), *cos_sin)
        out = self.attn(q, k, v.reshape(tokens, hk, d), kv_layer, meta)               # [T, h, D]
        out = out.reshape(tokens, h * d) * torch.sigmoid(gate.reshape(tokens, h * d))
        return self.o_proj(out)


class HybridLayer(nn.Module):
    def __init__(self, kind: str, dims: ModelDims, linear: LinearDims, rotary_dims: int, moe: MoESpec | None,
                 tp: TPGroup, dtype, device) -> None:
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype, device, 1.0)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype, device, 1.0)
        if kind == LINEAR:
            self.linear_attn = GatedDeltaNet(dims.hidden_size, linear, tp, dtype, device)
        else:
            self.self_attn = GatedAttention(dims, rotary_dims, tp, dtype, device)
        if moe is None:
            self.mlp = DecoderMLP(dims, ArchSpec(), tp, dtype, device)
        else:
            shared = DecoderMLP(replace(dims, intermediate_size=moe.shared_intermediate_size), ArchSpec(), tp, dtype,
                                device) if moe.shared_intermediate_size else None
            self.mlp = SparseMoE(dims.hidden_size, moe, tp, dtype, device, shared)

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        self.input_layernorm.load(reader, f"{prefix}.input_layernorm.weight")
        self.post_attention_layernorm.load(reader, f"{prefix}.post_attention_layernorm.weight")
        if self.kind == LINEAR:
            self.linear_attn.load(reader, f"{prefix}.linear_attn")
        else:
            self.self_attn.load(reader, f"{prefix}.self_attn")
        self.mlp.load(reader, f"{prefix}.mlp")

    def forward(self, hidden, residual, cos_sin, kv_layer, meta, step: StateStep):
        # returns (mlp output, residual stream before it), both [T, hidden]
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.kind == LINEAR:
            hidden = self.linear_attn(hidden, step)
        else:
            hidden = self.self_attn(hidden, cos_sin, kv_layer, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3_5ForCausalLM(nn.Module):
    lora = None           # ModelLora.attach sets it (enable_lora): slots on the full-attention layers and dense MLPs
    cpu_decode = None     # the one-call CPU decode takes plain decoder layers only
    decode_reads_host = True   # CPU decode steps: False takes CUDA's path (no host reads), as the CPU tests do

    @property
    def graph_safe(self) -> bool:
        """Decode steps capture in CUDA graphs unless an MLP reads tensor values on the host (module docstring)."""
        return all(getattr(layer.mlp, "graph_safe", True) for layer in self.layers)

    @staticmethod
    def dims_of(hf_config) -> ModelDims:
        """The decoder dimensions of ``hf_config`` (a MoE config's intermediate size: its shared expert's)."""
        return _dims(hf_config)

    @classmethod
    def validate_config(cls, hf_config, max_model_len: int, tp_size: int) -> None:
        dims = _dims(hf_config)
        _layer_types(hf_config)
        check_head_split(dims.num_heads, dims.num_kv_heads, tp_size)
        LinearDims.from_hf(hf_config).check_split(tp_size)
        moe = _moe(hf_config)
        if moe is None:
            check_even_split(dims.intermediate_size, tp_size, "intermediate_size")
        else:
            check_even_split(moe.intermediate_size, tp_size, "moe_intermediate_size")
            if moe.shared_intermediate_size:
                check_even_split(moe.shared_intermediate_size, tp_size, "shared_expert_intermediate_size")
        rotary_dims, params = _rope(hf_config)
        RotaryEmbedding(rotary_dims, params, torch.device("cpu"), max_model_len)

    def __init__(self, hf_config, tp: TPGroup, dtype: torch.dtype, device: torch.device, max_model_len: int) -> None:
        super().__init__()
        self.validate_config(hf_config, max_model_len, tp.world_size)
        self.dims = dims = _dims(hf_config)
        self.tp = tp
        self.kinds = _layer_types(hf_config)
        rotary_dims, params = _rope(hf_config)
        self.rotary = RotaryEmbedding(rotary_dims, params, device, max_model_len)
        linear, moe = LinearDims.from_hf(hf_config), _moe(hf_config)
        self.embed_tokens = VocabParallelEmbedding(dims.vocab_size, dims.hidden_size, tp, dtype, device)
        self.layers = nn.ModuleList(HybridLayer(kind, dims, linear, rotary_dims, moe, tp, dtype, device)
                                    for kind in self.kinds)
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype, device, 1.0)
        self.lm_head = ParallelLMHead(self.embed_tokens, tied=dims.tie_word_embeddings)
        # layer index -> its KV layer (full attention only) or None
        self.kv_index = [None] * len(self.kinds)
        for n, i in enumerate(i for i, kind in enumerate(self.kinds) if kind == FULL):
            self.kv_index[i] = n
        self.num_state_slots = 0
        self.weights_prefix = getattr(hf_config, "weights_prefix", "model")   # a multimodal checkpoint's text part

    @property
    def num_kv_layers(self) -> int:
        return sum(kind == FULL for kind in self.kinds)

    @property
    def num_local_kv_heads(self) -> int:
        return next(layer.self_attn.num_kv_heads for layer in self.layers if layer.kind == FULL)

    def allocate_states(self, num_slots: int) -> int:
        """One state slot per sequence the scheduler may run (``max_num_seqs``) in every linear layer; returns
        their bytes on this rank."""
        self.num_state_slots = num_slots
        return sum(layer.linear_attn.allocate_states(num_slots).nbytes for layer in self.layers if layer.kind == LINEAR)

    def check_snapshots(self, snapshots: list[tuple[int, int, int]]) -> None:
        """ValueError unless every (seat, position, snapshot slot) names slots of the pool and a position >= 1
        (that the seat's sequence computes it this step is checked by the forward)."""
        for seat, position, target in snapshots:
            if not (0 <= seat < self.num_state_slots and 0 <= target < self.num_state_slots and position >= 1
                    and seat != target):
                raise ValueError(f"state_snapshots: ({seat}, {position}, {target}) names a slot outside "
                                 f"[0, {self.num_state_slots}), the same slot twice or a position < 1")

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """(src, dst) slot pairs, in order, in every linear layer (before the step's forward): a fork's
        (parent, child), a prefix hit's (snapshot, seat)."""
        for pair in pairs:
            if not all(0 <= s < self.num_state_slots for s in pair):
                raise ValueError(f"state_copies: pair {pair} is outside [0, {self.num_state_slots})")
        for layer in self.layers:
            if layer.kind == LINEAR:
                layer.linear_attn.states.copy(pairs)

    def load_weights(self, reader: CheckpointReader) -> None:
        load_decoder_weights(self, reader, self.weights_prefix)

    def _state_step(self, positions: torch.Tensor, meta: AttentionMetadata) -> StateStep:
        if meta.state_slots is None:
            raise ValueError("state_slots: a hybrid model's step needs each sequence's state slot")
        slots = meta.state_slots.long()
        slots = torch.where(slots < 0, torch.full_like(slots, self.num_state_slots), slots)   # padding: scratch
        first = meta.cu_seqlens_q[:-1].long()
        fresh = positions.long()[first] == 0                                                  # [seqs]
        cu_seqlens = meta.cu_seqlens_q
        if meta.max_query_len == 1 and positions.shape[0] == slots.shape[0]:
            # a decode step's snapshots end its one token: the seats' states after the forward (a trailing snapshot)
            after = tuple((seat, target) for seat, _, target in meta.state_snapshots)
            if slots.is_cuda or not self.decode_reads_host:   # no host reads: nothing waits for the GPU here
                return StateStep(slots, fresh, None, cu_seqlens=cu_seqlens, after=after)
            host = slots.tolist()
            if after:
                self._snapshot_cuts(meta.state_snapshots, positions.tolist(), list(range(len(host) + 1)), host)
            ordered = host == list(range(host[0], host[0] + len(host))) if host else False
            return StateStep(slots, fresh, None, (host[0], host[0] + len(host)) if ordered else None,
                             bool(fresh.any()), cu_seqlens, after)
        cu, host_slots = cu_seqlens.tolist(), slots.tolist()
        cuts = self._snapshot_cuts(meta.state_snapshots, positions[first].tolist(), cu, host_slots)
        spans = [(a, b, s, f, cuts.get(i, ())) for i, (a, b, s, f) in enumerate(zip(cu, cu[1:], host_slots,
                                                                                      fresh.tolist())) if b > a]
        return StateStep(slots, fresh, spans, cu_seqlens=cu_seqlens)

    @staticmethod
    def _snapshot_cuts(snapshots, first_positions: list[int], cu: list[int], slots: list[int]
                       ) -> dict[int, tuple[tuple[int, int], ...]]:
        """Row -> its (offset within the step's tokens, snapshot slot) cuts, ascending, from the plan's
        (seat, position, snapshot slot) triples; ValueError for a position the seat's row does not compute."""
        if not snapshots:
            return {}
        row_of = {slot: i for i, slot in enumerate(slots) if cu[i + 1] > cu[i]}
        cuts: dict[int, list[tuple[int, int]]] = {}
        for seat, position, target in snapshots:
            row = row_of.get(seat)
            offset = -1 if row is None else position - first_positions[row]
            if row is None or not 0 < offset <= cu[row + 1] - cu[row]:
                raise ValueError(f"state_snapshots: seat {seat} computes no token ending at position {position} in "
                                 "this step")
            cuts.setdefault(row, []).append((offset, target))
        return {row: tuple(sorted(pairs)) for row, pairs in cuts.items()}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        # input_ids, positions [tokens]; kv_cache: the full-attention layers' KV on this rank
        hidden = self.embed_tokens(input_ids)                                     # [T, hidden]
        cos_sin = self.rotary.cos_sin(positions, hidden.dtype)                   # [T, 1, rotary_dims] each
        step = self._state_step(positions, meta)
        residual = None
        for layer, kv in zip(self.layers, self.kv_index):
            hidden, residual = layer(hidden, residual, cos_sin, None if kv is None else kv_cache.layer(kv), meta, step)
        if step.after:
            self.copy_states(list(step.after))
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        # hidden [rows, hidden] -> float32 logits [rows, vocab] on rank 0, None elsewhere
        return self.lm_head(hidden)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """The same model with ``SparseMoE`` MLPs (``_moe`` reads ``num_experts`` from the config)."""
