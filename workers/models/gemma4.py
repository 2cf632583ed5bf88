"""Gemma 4 text models (``Gemma4ForCausalLM``, dense and MoE; the multimodal ``Gemma4ForConditionalGeneration``
checkpoints as their text model: ``model_info.TEXT_OF_MULTIMODAL``, the ``model.language_model.*`` tensors, no
vision or audio tower, so an image or audio request stays a 400).

What a config declares is read and checked by ``gemma4_config.read_layout``; the layers are
``gemma4_layers.py``. Model-wide:

- embeddings scaled by sqrt(hidden_size) in the weights' dtype; the LM head tied unless
  ``tie_word_embeddings: false``; ``final_logit_softcapping``: ``cap * tanh(logits / cap)`` on the float32 logits;
- one rope per layer kind: the sliding layers' (``default``, their ``head_dim``) and the full layers'
  (``proportional``: only the first ``partial_rotary_factor`` of each head's frequency pairs rotate; its
  ``head_dim``), cos / sin computed once per step per kind;
- per-layer inputs (PLE, ``hidden_size_per_layer_input`` = P > 0): per token, a table row of
  ``embed_tokens_per_layer`` (vocab-parallel like the embedding, scaled by sqrt(P)) and a projection of the scaled
  embedding (``per_layer_model_projection``, replicated, times hidden_size^-0.5, RMS-normed per layer), summed and
  scaled by 2^-0.5: [tokens, layers, P], layer i reading its slice.

KV cache: a KV-shared layer owns no row of the cache and reads its source layer's (``kv_slots``); the layers that
own rows may differ in head shape (``kv_layer_shapes``), and then the cache holds one tensor per shape
(``workers/kv_cache.py``): a sliding layer's block costs its own KV heads x head_dim, a full layer's its own, none
padded to the other's. The cost per block and rank is ``2 x block_size x dtype bytes x sum over the owning layers of
kv_heads_local x head_dim``, the same as if each shape had its own cache.

Tensor parallelism: each layer's heads split as the other families' (``partition.py``: KV heads fewer than the ranks
are replicated; a count neither dividing nor divided by the ranks is refused, per layer kind); the dense MLP's
columns and every expert's intermediate slice split; the PLE table vocab-parallel, its projections and the
per-layer gate / projection replicated. Transfers of KV between replicas of different TP sizes are refused for a
cache of several shapes (``kv_blocks.reshard_rows``); a block's bytes for transfers between replicas follow from
``ModelInfo.kv_layer_shapes`` (the KV-holding layers), not from ``num_hidden_layers``.

Not built: LoRA (``lora = None``), the one-call CPU decode (``cpu_decode = None``: it takes Llama-style decoder
layers only). CUDA graphs: the forward reads nothing on the host (the experts take ``kernels.fused_moe``'s
grouped Triton GEMMs on CUDA), so decode steps are captured at TP=1 like the other families'; checked through
the graphs' static buffers eagerly on CPU, not yet captured on a GPU.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..kv_cache import KVCache
from ..layers.attention import AttentionMetadata
from ..layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ..layers.linear import ColumnParallelLinear
from ..layers.norm import RMSNorm
from ..layers.partition import check_even_split, check_head_split
from ..layers.rotary import RotaryEmbedding
from ..tp_group import TPGroup
from ..weights.weight_loader import CheckpointReader
from .decoder import ModelDims, load_decoder_weights
from .gemma3 import soft_capped
from .gemma4_config import Gemma4Layout, layer_value, read_layout
from .gemma4_layers import Gemma4Layer


def _dims(cfg) -> ModelDims:
    """Model-wide sizes; the KV head count and head_dim are layer 0's (each layer has its own: ``LayerPlan``)."""
    first = (layer_value(cfg, 0, "num_key_value_heads"), layer_value(cfg, 0, "head_dim"))
    return ModelDims(cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers,
                     cfg.num_attention_heads, *first, cfg.rms_norm_eps, bool(getattr(cfg, "tie_word_embeddings", True)))


class PerLayerInputs(nn.Module):
    """input_ids [T], scaled embeddings [T, H] -> every layer's per-layer input [T, layers, P] (module docstring)."""

    def __init__(self, dims: ModelDims, layout: Gemma4Layout, tp: TPGroup, dtype, device) -> None:
        super().__init__()
        self.layers, self.size, self.hidden_size = dims.num_layers, layout.ple_size, dims.hidden_size
        width = self.layers * self.size
        self.table = VocabParallelEmbedding(layout.ple_vocab, width, tp, dtype, device)      # [V_ple / tp, L P]
        self.projection = ColumnParallelLinear.replicated(dims.hidden_size, width, False, dtype, device)
        self.norm = RMSNorm(self.size, dims.rms_norm_eps, dtype, device)

    def load(self, reader: CheckpointReader, prefix: str) -> None:
        self.table.load(reader, f"{prefix}.embed_tokens_per_layer.weight")
        self.projection.load(reader, [f"{prefix}.per_layer_model_projection"])
        self.norm.load(reader, f"{prefix}.per_layer_projection_norm.weight")

    def forward(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        tokens, dtype = input_ids.shape[0], embeds.dtype
        token = self.table(input_ids) * torch.tensor(self.size ** 0.5, dtype=dtype)          # [T, L P]
        context = self.projection(embeds) * self.hidden_size ** -0.5                        # [T, L P]
        context = self.norm(context.view(tokens, self.layers, self.size))                   # [T, L, P]
        return (context + token.view(tokens, self.layers, self.size)) * 2.0 ** -0.5


class Gemma4ForCausalLM(nn.Module):
    lora = None           # LoRA is not wired for these layers (ModelLora refuses models it does not know)
    cpu_decode = None     # the one-call CPU decode takes Llama-style decoder layers only
    graph_safe = True     # decode steps replay CUDA graphs on CUDA (module docstring)

    @classmethod
    def validate_config(cls, hf_config, max_model_len: int, tp_size: int) -> None:
        """Every check the constructor makes, without allocating anything (ValueError naming the field)."""
        layout, dims = read_layout(hf_config, max_model_len), _dims(hf_config)
        for heads in sorted({plan.num_kv_heads for plan in layout.layers}):
            check_head_split(dims.num_heads, heads, tp_size)
        for size in sorted({plan.intermediate_size for plan in layout.layers}):
            check_even_split(size, tp_size, "intermediate_size (x2 on KV-shared layers with use_double_wide_mlp)")
        if layout.moe is not None:
            check_even_split(layout.moe.intermediate_size, tp_size, "moe_intermediate_size")
        for kind, params in layout.ropes.items():
            RotaryEmbedding(cls._head_dim_of(layout, kind), params, torch.device("cpu"), max_model_len)

    @classmethod
    def kv_layer_shapes_of(cls, hf_config) -> tuple[tuple[int, int], ...]:
        """(KV heads, head_dim), all ranks together, of each layer that holds KV, in cache-row order (model_info)."""
        return read_layout(hf_config, hf_config.max_position_embeddings).kv_shapes()

    @staticmethod
    def _head_dim_of(layout: Gemma4Layout, kind: str) -> int:
        return next(plan.head_dim for plan in layout.layers if plan.kind == kind)

    def __init__(self, hf_config, tp: TPGroup, dtype: torch.dtype, device: torch.device, max_model_len: int) -> None:
        super().__init__()
        self.validate_config(hf_config, max_model_len, tp.world_size)
        layout = read_layout(hf_config, max_model_len)
        self.dims = dims = _dims(hf_config)
        self.tp = tp
        self.rotary = {kind: RotaryEmbedding(self._head_dim_of(layout, kind), params, device, max_model_len)
                       for kind, params in layout.ropes.items()}
        self.embed_tokens = VocabParallelEmbedding(dims.vocab_size, dims.hidden_size, tp, dtype, device)
        self.embed_scale = math.sqrt(dims.hidden_size)
        self.per_layer_inputs = PerLayerInputs(dims, layout, tp, dtype, device) if layout.ple_size else None
        self.layers = nn.ModuleList(Gemma4Layer(plan, dims, layout.bias, layout.moe, layout.ple_size, tp, dtype, device)
                                    for plan in layout.layers)
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype, device)
        self.lm_head = ParallelLMHead(self.embed_tokens, tied=dims.tie_word_embeddings)
        self.final_softcap = layout.final_softcap
        self.kv_slots = layout.kv_slots                       # layer -> its cache row (a shared layer: its source's)
        self.weights_prefix = getattr(hf_config, "weights_prefix", "model")   # a multimodal checkpoint's text part

    @property
    def kv_layer_shapes(self) -> tuple[tuple[int, int], ...]:
        """(kv_heads_local, head_dim) of each layer that holds KV on this rank, in cache-row order."""
        return tuple((layer.self_attn.num_kv_heads, layer.self_attn.head_dim) for layer in self.layers
                     if not layer.self_attn.shared)

    @property
    def num_kv_layers(self) -> int:
        return len(self.kv_layer_shapes)

    @property
    def num_local_kv_heads(self) -> int:
        return self.kv_layer_shapes[0][0]

    def load_weights(self, reader: CheckpointReader) -> None:
        load_decoder_weights(self, reader, self.weights_prefix)
        if self.per_layer_inputs is not None:
            self.per_layer_inputs.load(reader, self.weights_prefix)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        # input_ids, positions [tokens]; kv_cache: this rank's shard (one row per KV-owning layer)
        hidden = self.embed_tokens(input_ids)                                     # [T, hidden]
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        ple = None if self.per_layer_inputs is None else self.per_layer_inputs(input_ids, hidden)   # [T, L, P]
        cos_sin = {kind: rotary.cos_sin(positions, hidden.dtype) for kind, rotary in self.rotary.items()}
        for i, (layer, slot) in enumerate(zip(self.layers, self.kv_slots)):
            hidden = layer(hidden, None if ple is None else ple[:, i], cos_sin[layer.kind], kv_cache.layer(slot), meta)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        # hidden [rows, hidden] -> float32 logits [rows, vocab] on rank 0 (soft-capped when configured), None elsewhere
        return soft_capped(self.lm_head(hidden), self.final_softcap)
