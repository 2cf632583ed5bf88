"""Gemma 3, text only (``Gemma3ForCausalLM``), and Gemma 2 (``Gemma2ForCausalLM``): the shared decoder's
attention and MLP with Gemma's choices.

- RMSNorm scales by ``1 + weight`` (the offset is added to the checkpoint weight at load, in float32),
  also for the per-head q/k norms; four norms per layer: the attention's and the MLP's outputs are normed
  before they join the residual stream (``input_layernorm`` -> attention -> ``post_attention_layernorm`` ->
  + residual -> ``pre_feedforward_layernorm`` -> MLP -> ``post_feedforward_layernorm`` -> + residual).
- Embeddings scaled by sqrt(hidden_size) (in the weights' dtype, as transformers does); the LM head is tied
  unless the config says ``tie_word_embeddings: false`` (then ``lm_head.weight`` is read).
- The MLP gates with GELU-tanh; the softmax scale is ``query_pre_attn_scalar ** -0.5``.
- ``layer_types`` alternate local layers (``sliding_window``) and global ones, each kind with its own rope
  (``rope_parameters["sliding_attention"]`` / ``["full_attention"]``: base and scaling).

Gemma 2 differs: no q/k norms, one rope for every layer (``rope_theta``), local and global layers alternating,
and soft-capping: of the attention scores (``attn_logit_softcapping``, in every attention kernel) and of the
final logits (``final_logit_softcapping``: cap * tanh(logits / cap) on the float32 logits).

Refused before any weight is read (a ValueError naming it): soft-capping on Gemma 3 (its configs have none),
bidirectional attention, another activation.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..kv_cache import KVCache
from ..layers.attention import AttentionMetadata
from ..layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ..layers.norm import RMSNorm
from ..layers.partition import check_even_split, check_head_split
from ..layers.rotary import RotaryEmbedding, RotaryStep, rope_parameters
from ..tp_group import TPGroup
from ..weights.weight_loader import CheckpointReader
from .decoder import ArchSpec, DecoderAttention, DecoderForCausalLM, DecoderMLP, ModelDims, load_decoder_weights
from .llama import layer_types_of, sliding_window_of

LOCAL, GLOBAL = "sliding_attention", "full_attention"


def _rope(cfg, kind: str) -> dict:
    """One layer kind's rope settings in ``RotaryEmbedding``'s form."""
    params = dict((getattr(cfg, "rope_parameters", None) or {}).get(kind) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", 1_000_000.0 if kind == GLOBAL else 10_000.0)
    return params


def soft_capped(logits: torch.Tensor | None, cap: float | None) -> torch.Tensor | None:
    """``final_logit_softcapping``: cap * tanh(logits / cap) on rank 0's float32 logits (None, no cap: as given)."""
    if logits is None or cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


class Gemma3Layer(nn.Module):
    def __init__(self, dims: ModelDims, spec: ArchSpec, tp: TPGroup, dtype, device, index: int) -> None:
        super().__init__()
        norm = lambda: RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype, device, spec.norm_offset)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = DecoderAttention(dims, spec, tp, dtype, device, spec.window_of(index))
        self.mlp = DecoderMLP(dims, spec, tp, dtype, device)

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            getattr(self, name).load(reader, f"{prefix}.{name}.weight")
        self.self_attn.load(reader, f"{prefix}.self_attn")
        self.mlp.load(reader, f"{prefix}.mlp")

    def forward(self, hidden, rope: RotaryStep, kv_layer, meta: AttentionMetadata) -> torch.Tensor:
        # hidden [tokens, hidden] (the residual stream) -> the stream after this layer
        hidden = hidden + self.post_attention_layernorm(self.self_attn(self.input_layernorm(hidden), rope,
                                                                       kv_layer, meta))
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class Gemma3ForCausalLM(DecoderForCausalLM):
    SOFTCAP = False     # Gemma 2 soft-caps; Gemma 3's configs never do
    takes_last_layer_rows = False   # its forward runs every row through every layer
    QK_NORM = True

    @classmethod
    def rope_of(cls, hf_config, kind: str) -> dict:
        return _rope(hf_config, kind)

    @classmethod
    def arch_spec(cls, hf_config, max_model_len: int) -> ArchSpec:
        if not cls.SOFTCAP:
            for name in ("attn_logit_softcapping", "final_logit_softcapping"):
                if getattr(hf_config, name, None) is not None:
                    raise ValueError(f"model: {name} is not supported on this architecture")
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError("model: use_bidirectional_attention is not supported")
        act = getattr(hf_config, "hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"model: hidden_activation {act!r} is not supported (only 'gelu_pytorch_tanh')")
        types = layer_types_of(hf_config)
        softcap = getattr(hf_config, "attn_logit_softcapping", None) if cls.SOFTCAP else None
        return ArchSpec(qk_norm=cls.QK_NORM, attn_softcap=softcap,
                        sliding_window=sliding_window_of(hf_config, max_model_len),
                        sliding_layers=tuple(t == LOCAL for t in types), norm_offset=1.0, gelu_tanh=True,
                        attn_scale=hf_config.query_pre_attn_scalar ** -0.5,
                        qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
                        o_bias=bool(getattr(hf_config, "attention_bias", False)))

    @classmethod
    def validate_config(cls, hf_config, max_model_len: int, tp_size: int) -> None:
        cls.arch_spec(hf_config, max_model_len)
        dims = ModelDims.from_hf(hf_config)
        check_head_split(dims.num_heads, dims.num_kv_heads, tp_size)
        check_even_split(dims.intermediate_size, tp_size, "intermediate_size")
        for kind in (LOCAL, GLOBAL):
            RotaryEmbedding(dims.head_dim, cls.rope_of(hf_config, kind), torch.device("cpu"), max_model_len)

    def __init__(self, hf_config, tp: TPGroup, dtype: torch.dtype, device: torch.device,
                 max_model_len: int) -> None:
        nn.Module.__init__(self)
        spec = self.arch_spec(hf_config, max_model_len)
        self.dims = dims = ModelDims.from_hf(hf_config)
        self.tp = tp
        self.kinds = layer_types_of(hf_config)
        self.rotary = {kind: RotaryEmbedding(dims.head_dim, self.rope_of(hf_config, kind), device, max_model_len)
                       for kind in (LOCAL, GLOBAL)}
        final = getattr(hf_config, "final_logit_softcapping", None) if self.SOFTCAP else None
        self.final_softcap = float(final) if final is not None else None
        self.embed_tokens = VocabParallelEmbedding(dims.vocab_size, dims.hidden_size, tp, dtype, device)
        self.embed_scale = math.sqrt(dims.hidden_size)
        self.layers = nn.ModuleList(Gemma3Layer(dims, spec, tp, dtype, device, i) for i in range(dims.num_layers))
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype, device, spec.norm_offset)
        self.lm_head = ParallelLMHead(self.embed_tokens, tied=dims.tie_word_embeddings)

    def load_weights(self, reader: CheckpointReader) -> None:
        load_decoder_weights(self, reader)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        # input_ids, positions [tokens]; kv_cache: this rank's shard (workers.kv_cache)
        hidden = self.embed_tokens(input_ids)                                     # [tokens, hidden]
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        ropes = {kind: rotary.for_step(positions, hidden.dtype) for kind, rotary in self.rotary.items()}
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, ropes[self.kinds[i]], kv_cache.layer(i), meta)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        # hidden [rows, hidden] -> float32 logits [rows, vocab] on rank 0 (soft-capped on Gemma 2), None elsewhere
        return soft_capped(self.lm_head(hidden), self.final_softcap)


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    SOFTCAP = True
    QK_NORM = False

    @classmethod
    def rope_of(cls, hf_config, kind: str) -> dict:
        return rope_parameters(hf_config)    # one rope for local and global layers
