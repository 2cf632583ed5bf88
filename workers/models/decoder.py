"""The pre-norm decoder-only transformer shared by Llama, Mistral, Qwen2, Qwen3 and Phi-3.

The families differ only in the switches of ``ArchSpec`` (projection biases, per-head q/k RMSNorm, a
sliding window on every layer or on some (transformers' ``layer_types``), checkpoints with fused
``qkv_proj`` / ``gate_up_proj``);
each model module derives the spec from its Hugging Face config and subclasses
``DecoderForCausalLM``. Checkpoint names follow the Hugging Face layout
(``model.layers.{i}.self_attn.q_proj.weight`` ...).

Per layer and rank: merged QKV (column-parallel) -> [q/k RMSNorm] -> rotary -> paged attention over
this rank's KV heads -> o_proj (row-parallel, one all-reduce) -> merged gate/up (column-parallel)
-> SiLU*up -> down_proj (row-parallel, one all-reduce). Two all-reduces per layer, plus one for the
embedding and one gather for the logits per step.

The small ops (RMSNorm, q/k norm, rotary, SiLU*up) run through ``pagedray.kernels``: fused Triton
kernels on CUDA; on CPU one C call each for RMSNorm and rotary (``cpu_fused.c``: the torch code's
arithmetic op for op, but for the order of the norm's sum of squares) and torch ops for SiLU*up. On
the fused path the q/k norm and the rotary rewrite q and k inside the fresh qkv projection output, in place.
Nothing in the forward reads tensor values on the host, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import nn

from ..kv_cache import KVCache
from ..layers.activation import gelu_tanh_and_mul, silu_and_mul
from ..layers.attention import AttentionMetadata, LastLayerRows, PagedAttention
from ..layers.clamped_moe import ClampedSwigluMoE
from ..layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ..layers.linear import ColumnParallelLinear, RowParallelLinear
from ..layers.moe import MoESpec, SparseMoE
from ..layers.norm import RMSNorm
from ..layers.partition import HeadPartition, check_even_split, check_head_split
from ..layers.rotary import RotaryEmbedding, RotaryStep, rope_parameters
from ..tp_group import TPGroup
from ..weights.weight_loader import CheckpointReader, copy_into


class DecodeShortcut(Protocol):
    """A decode step's layers in one call (cpu_decode_layers.CpuDecodeLayers, set by model_loading.pack_for_cpu)."""

    def takes(self, kv_cache: KVCache, hidden: torch.Tensor, meta: AttentionMetadata) -> bool: ...

    def forward_layers(self, hidden: torch.Tensor, rope: RotaryStep, kv_cache: KVCache, meta: AttentionMetadata
                       ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class ArchSpec:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None   # keys within this many positions of the query (itself included)
    sliding_layers: tuple[bool, ...] | None = None   # which layers use the window (None: every layer)
    fused_checkpoint: bool = False      # the checkpoint stores qkv_proj and gate_up_proj fused (Phi-3)
    attn_scale: float | None = None     # softmax scale (None: head_dim ** -0.5; Gemma: query_pre_attn_scalar)
    norm_offset: float = 0.0            # added to every RMSNorm weight at load (Gemma's 1 + w)
    gelu_tanh: bool = False             # the MLP gates with GELU-tanh instead of SiLU (Gemma)
    attn_softcap: float | None = None   # attention logit soft-capping (Gemma 2)
    moe: MoESpec | None = None          # sparse experts (layers/moe.py) on the layers moe_layers marks
    moe_layers: tuple[bool, ...] = ()
    attn_sinks: bool = False            # a learned logit per query head in every softmax (gpt-oss's ``sinks``)

    def window_of(self, layer: int) -> int | None:
        if self.sliding_layers is None or self.sliding_window is None:
            return self.sliding_window
        return self.sliding_window if self.sliding_layers[layer] else None


@dataclass(frozen=True)
class ModelDims:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, cfg) -> ModelDims:
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"model: hidden_act {cfg.hidden_act!r} is not supported (only 'silu')")
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # a sequence-classification checkpoint has a ``score`` head instead of an LM head: the LM head reuses the
        # embedding (its logits mean nothing), and the front applies ``score`` to the pooled hidden state
        # (cluster/pooling.py)
        tied = bool(getattr(cfg, "tie_word_embeddings", False)) or is_classifier(cfg)
        return cls(cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
                   cfg.num_attention_heads, num_kv_heads, head_dim, cfg.rms_norm_eps, tied)


def is_classifier(cfg) -> bool:
    """A ``*ForSequenceClassification`` checkpoint (its head is ``score.weight``, [num_labels, hidden])."""
    return any(str(name).endswith("ForSequenceClassification") for name in getattr(cfg, "architectures", None) or [])


class DecoderAttention(nn.Module):
    def __init__(self, dims: ModelDims, spec: ArchSpec, tp: TPGroup, dtype, device, window: int | None) -> None:
        super().__init__()
        heads = HeadPartition(dims.num_heads, dims.num_kv_heads, tp.world_size, tp.rank)
        self.head_dim = dims.head_dim
        self.num_heads = heads.num_local_heads
        self.num_kv_heads = heads.num_local_kv_heads
        self.qkv_proj = ColumnParallelLinear.qkv(dims.hidden_size, dims.head_dim, heads, spec.qkv_bias,
                                                 dtype, device)
        self.o_proj = RowParallelLinear(dims.num_heads * dims.head_dim, dims.hidden_size, spec.o_bias, tp,
                                        dtype, device, name="num_attention_heads * head_dim")
        offset = spec.norm_offset
        self.q_norm = RMSNorm(dims.head_dim, dims.rms_norm_eps, dtype, device, offset) if spec.qk_norm else None
        self.k_norm = RMSNorm(dims.head_dim, dims.rms_norm_eps, dtype, device, offset) if spec.qk_norm else None
        scale = spec.attn_scale if spec.attn_scale is not None else dims.head_dim ** -0.5
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, dims.head_dim, scale, window, spec.attn_softcap)
        if spec.attn_sinks:      # float32 [heads_local]: this rank's query heads' sinks
            self.attn.sinks = torch.zeros(self.num_heads, dtype=torch.float32, device=device)
        self.first_head = heads.first_head
        self.fused_checkpoint = spec.fused_checkpoint

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        if self.fused_checkpoint:
            self.qkv_proj.load_fused(reader, f"{prefix}.qkv_proj")
        else:
            self.qkv_proj.load(reader, [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"])
        self.o_proj.load(reader, f"{prefix}.o_proj")
        if self.q_norm is not None:
            self.q_norm.load(reader, f"{prefix}.q_norm.weight")
            self.k_norm.load(reader, f"{prefix}.k_norm.weight")
        if self.attn.sinks is not None:
            name = f"{prefix}.sinks"
            copy_into(self.attn.sinks, reader.read(name, 0, self.first_head, self.first_head + self.num_heads), name)
        self.attn.load_kv_scales(reader, prefix)

    def forward(self, hidden, rope: RotaryStep, kv_layer, meta: AttentionMetadata,
                keep: LastLayerRows | None = None) -> torch.Tensor:
        # hidden [tokens, hidden] -> [tokens, hidden] ([kept, hidden] with keep); q, k, v: views of the fused projection
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden).view(tokens, -1, self.head_dim)      # [tokens, Hq + 2 Hkv, D]
        q_end, k_end = self.num_heads, self.num_heads + self.num_kv_heads
        if rope.fused:                       # Triton: normalise and rotate q and k inside qkv, in place
            q, k = qkv[:, :q_end], qkv[:, q_end:k_end]
            if self.q_norm is not None:
                self.q_norm(q, out=q)
                self.k_norm(k, out=k)
            rope.rotate_(q, k)
        elif self.q_norm is None:
            qk = rope.apply(qkv[:, :k_end])                               # q and k rotated together
            q, k = qk[:, :q_end], qk[:, q_end:]
        else:
            q = rope.apply(self.q_norm(qkv[:, :q_end]))
            k = rope.apply(self.k_norm(qkv[:, q_end:k_end]))
        out = self.attn(q, k, qkv[:, k_end:], kv_layer, meta, keep)    # [tokens or kept, heads_local, head_dim]
        if out.shape[0] == 0:                 # keep without rows: only the keys and values were wanted
            return hidden.new_empty((0, hidden.shape[1]))
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim))


class DecoderMLP(nn.Module):
    def __init__(self, dims: ModelDims, spec: ArchSpec, tp: TPGroup, dtype, device) -> None:
        super().__init__()
        size = dims.intermediate_size
        self.gate_up_proj = ColumnParallelLinear.merged(dims.hidden_size, [size, size], spec.mlp_bias, tp,
                                                        dtype, device)
        self.down_proj = RowParallelLinear(size, dims.hidden_size, spec.mlp_bias, tp, dtype, device,
                                           name="intermediate_size")
        self.fused_checkpoint = spec.fused_checkpoint
        self.act = gelu_tanh_and_mul if spec.gelu_tanh else silu_and_mul
        self.gate_up_proj.silu_after = not spec.gelu_tanh

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        if self.fused_checkpoint:
            self.gate_up_proj.load_fused(reader, f"{prefix}.gate_up_proj")
        else:
            self.gate_up_proj.load(reader, [f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        self.down_proj.load(reader, f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj.silu_after:
            return self.down_proj(self.gate_up_proj.forward_silu_and_mul(x))
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, dims: ModelDims, spec: ArchSpec, tp: TPGroup, dtype, device, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype, device)
        self.self_attn = DecoderAttention(dims, spec, tp, dtype, device, spec.window_of(index))
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype, device)
        sparse = spec.moe is not None and spec.moe_layers[index]
        if not sparse:
            self.mlp = DecoderMLP(dims, spec, tp, dtype, device)
        elif spec.moe.swiglu_limit is not None:
            self.mlp = ClampedSwigluMoE(dims.hidden_size, spec.moe, tp, dtype, device)
        else:
            size = spec.moe.shared_intermediate_size
            shared = DecoderMLP(replace(dims, intermediate_size=size), spec, tp, dtype, device) if size else None
            self.mlp = SparseMoE(dims.hidden_size, spec.moe, tp, dtype, device, shared)

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        self.input_layernorm.load(reader, f"{prefix}.input_layernorm.weight")
        self.self_attn.load(reader, f"{prefix}.self_attn")
        self.post_attention_layernorm.load(reader, f"{prefix}.post_attention_layernorm.weight")
        self.mlp.load(reader, f"{prefix}.{getattr(self.mlp, 'checkpoint_name', 'mlp')}")

    def forward(self, hidden, residual, rope: RotaryStep, kv_layer, meta, keep: LastLayerRows | None = None):
        # returns (mlp output, residual stream before it), both [tokens, hidden] ([kept, hidden] with keep)
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, kv_layer, meta, keep)
        if keep is not None:
            if keep.rows.shape[0] == 0:       # nothing samples: the keys and values are stored, nothing else is wanted
                return hidden, hidden
            residual = residual.index_select(0, keep.rows)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


def load_decoder_weights(model: nn.Module, reader: CheckpointReader, prefix: str = "model") -> None:
    """Hugging Face's decoder layout: ``{prefix}.embed_tokens``, ``{prefix}.layers.{i}`` (each layer's ``load``),
    ``{prefix}.norm`` and ``lm_head`` (read only when the head is untied)."""
    model.embed_tokens.load(reader, f"{prefix}.embed_tokens.weight")
    for i, layer in enumerate(model.layers):
        layer.load(reader, f"{prefix}.layers.{i}")
    model.norm.load(reader, f"{prefix}.norm.weight")
    model.lm_head.load(reader, "lm_head.weight")


class DecoderForCausalLM(nn.Module):
    """Subclasses define ``arch_spec(hf_config, max_model_len) -> ArchSpec`` (and may reject configs)."""

    lora = None     # workers/lora/model_lora.ModelLora once LoRA slots are attached (enable_lora)
    # forward takes ``keep`` (LastLayerRows): the last layer finishes only the sampling rows (a subclass
    # with a forward of its own sets this False)
    takes_last_layer_rows = True

    @staticmethod
    def arch_spec(hf_config, max_model_len: int) -> ArchSpec:
        raise NotImplementedError

    @classmethod
    def validate_config(cls, hf_config, max_model_len: int, tp_size: int) -> None:
        """Every check the constructor would make, without allocating anything (ValueError)."""
        spec = cls.arch_spec(hf_config, max_model_len)
        dims = ModelDims.from_hf(hf_config)
        if spec.sliding_layers is not None and len(spec.sliding_layers) != dims.num_layers:
            raise ValueError(f"model: layer_types lists {len(spec.sliding_layers)} layers, num_hidden_layers is "
                             f"{dims.num_layers}")
        check_head_split(dims.num_heads, dims.num_kv_heads, tp_size)
        check_even_split(dims.intermediate_size, tp_size, "intermediate_size")
        if spec.moe is not None:
            check_even_split(spec.moe.intermediate_size, tp_size, "moe_intermediate_size")
        RotaryEmbedding(dims.head_dim, rope_parameters(hf_config), torch.device("cpu"), max_model_len)

    def __init__(self, hf_config, tp: TPGroup, dtype: torch.dtype, device: torch.device,
                 max_model_len: int) -> None:
        super().__init__()
        spec = self.arch_spec(hf_config, max_model_len)
        self.dims = dims = ModelDims.from_hf(hf_config)
        self.tp = tp
        self.rotary = RotaryEmbedding(dims.head_dim, rope_parameters(hf_config), device, max_model_len)
        self.embed_tokens = VocabParallelEmbedding(dims.vocab_size, dims.hidden_size, tp, dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(dims, spec, tp, dtype, device, i) for i in range(dims.num_layers))
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype, device)
        self.lm_head = ParallelLMHead(self.embed_tokens, tied=dims.tie_word_embeddings)
        self.cpu_decode: DecodeShortcut | None = None   # set when the weights are packed (model_loading)

    @property
    def graph_safe(self) -> bool:
        """False when a layer reads tensor values on the host (gpt-oss's expert loop): no CUDA graphs then."""
        return all(getattr(layer.mlp, "graph_safe", True) for layer in self.layers)

    @property
    def num_local_kv_heads(self) -> int:
        return self.layers[0].self_attn.num_kv_heads

    def load_weights(self, reader: CheckpointReader) -> None:
        load_decoder_weights(self, reader)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, keep: LastLayerRows | None = None) -> torch.Tensor:
        # input_ids, positions [tokens]; kv_cache: this rank's shard (workers.kv_cache)
        # -> [tokens, hidden], or with keep only keep.rows' hidden states [kept, hidden] (LastLayerRows)
        hidden = self.embed_tokens(input_ids)                                   # [tokens, hidden]
        rope = self.rotary.for_step(positions, hidden.dtype)                   # shared by every layer
        if self.cpu_decode is not None and self.cpu_decode.takes(kv_cache, hidden, meta):
            hidden, residual = self.cpu_decode.forward_layers(hidden, rope, kv_cache, meta)   # the same, in one C call
            if keep is not None:
                hidden, residual = hidden.index_select(0, keep.rows), residual.index_select(0, keep.rows)
        else:
            residual = None
            last = len(self.layers) - 1
            for i, layer in enumerate(self.layers):
                hidden, residual = layer(hidden, residual, rope, kv_cache.layer(i), meta, keep if i == last else None)
        if hidden.shape[0] == 0:
            return hidden
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        # hidden [rows, hidden] -> float32 logits [rows, vocab] on rank 0, None elsewhere
        return self.lm_head(hidden)
