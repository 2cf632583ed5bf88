"""The one-call CPU decode path of ``DecoderForCausalLM`` (``kernels/cpu_layers.c``): which models take
it, and the per-step arguments.

A decode step (every sequence schedules one token) of a qualifying model runs all its decoder layers in
one C call that makes, op for op, the calls the layer-by-layer path makes (bit for bit the same hidden
states); the embedding, the rotary tables and the final norm stay in Python. Why: at decode sizes the
Python around each layer's ~10 small calls (checks, allocations, ctypes, module dispatch) cost ~160-180 us a
layer on the 2-core VM, 5-6 ms of a 25 ms float32 SmolLM2 step at batch 16 (measured in
docs/design/workers.md).

Qualifies (checked once, when the weights are packed): CPU, TP = 1, float32 / bfloat16 with the C
libraries built, every layer a ``DecoderLayer`` with a SiLU MLP (no experts), no q/k norm, no attention
soft-capping, no bias but the qkv projection's, every linear weight tile-packed for ``cpu_gemm``, and the
model's own ``forward`` (Gemma's differs). Per step: a KV cache in the model's dtype or of 8-bit rows (int8 or
float8) and a block size the decode kernel takes. ``enforce_eager`` turns the path off (the layer-by-layer
path, whose modules forward hooks can see, as CUDA's eager steps).
"""

from __future__ import annotations

import ctypes

import torch
from pagedray.kernels import cpu_decode, cpu_gemm, cpu_layers
from pagedray.kernels.kv_quant import is_quantized

from ..kv_cache import KVCache
from ..layers.activation import silu_and_mul
from ..layers.attention import AttentionMetadata
from ..layers.rotary import RotaryStep


class CpuDecodeLayers:
    """Built by ``build`` for a qualifying model; ``run`` takes a decode step's embeddings."""

    def __init__(self, model) -> None:
        self.model = model
        first = model.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.inter = model.layers[0].mlp.down_proj.cols
        self.eps = float(model.layers[0].input_layernorm.eps)
        self._layers: ctypes.Array | None = None
        self._cache_key: tuple | None = None

    def takes(self, kv_cache: KVCache, hidden: torch.Tensor, meta: AttentionMetadata) -> bool:
        """True for a decode step (one token per sequence) over a cache this path can use (``_prepare``)."""
        return (meta.max_query_len == 1 and hidden.shape[0] == meta.seq_lens_k.shape[0]
                and self._prepare(kv_cache, hidden.dtype) is not None)

    def _prepare(self, kv_cache: KVCache, dtype: torch.dtype) -> ctypes.Array | None:
        """One ``LayerArgs`` per layer, or None for a cache this path cannot use; decided and built once per
        cache (a new cache tensor is a new key). Usable: a cache in the model's dtype, or of 8-bit rows that
        the decode kernel quantizes as it stores them (as the layer loop's ``store_kv_and_attend`` then does
        too, with a layer's checkpoint scales for float8), in a layout the decode kernel takes."""
        data, scales = kv_cache.data, kv_cache.scales
        key = (data.data_ptr(), tuple(data.shape), tuple(data.stride()), data.dtype, dtype,
               None if scales is None else (scales.data_ptr(), tuple(scales.shape), tuple(scales.stride())))
        if self._cache_key == key:
            return self._layers
        if data.dtype == dtype:
            usable = scales is None
        else:
            usable = is_quantized(data.dtype) and scales is not None and cpu_decode.stores_rows_into(data[0, 0])
        usable = usable and cpu_decode.supports(torch.empty((1, self.num_heads, self.head_dim), dtype=dtype),
                                                data[0, 0])
        self._layers, self._cache_key = (self._layer_args(kv_cache) if usable else None), key
        return self._layers

    def _layer_args(self, kv_cache: KVCache) -> ctypes.Array:
        array = (cpu_layers.LayerArgs * len(self.model.layers))()
        for i, layer in enumerate(self.model.layers):
            attn, mlp, kv = layer.self_attn, layer.mlp, kv_cache.layer(i)
            bias = attn.qkv_proj.bias
            array[i] = cpu_layers.LayerArgs(
                layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                attn.qkv_proj.packed_weight.data.data_ptr(), None if bias is None else bias.data_ptr(),
                attn.o_proj.packed_weight.data.data_ptr(), mlp.gate_up_proj.packed_weight.data.data_ptr(),
                mlp.down_proj.packed_weight.data.data_ptr(), kv.k.data_ptr(), kv.v.data_ptr(),
                None if kv.k_scale is None else kv.k_scale.data_ptr(),
                None if kv.v_scale is None else kv.v_scale.data_ptr(),
                int(attn.attn.sliding_window or 0), float(attn.attn.scale),
                *cpu_decode.static_scale_bits(attn.attn.checkpoint_kv_scales if kv.k.dtype == torch.float8_e4m3fn
                                              else None))
        return array

    def run(self, hidden: torch.Tensor, rope: RotaryStep, kv_cache: KVCache, meta: AttentionMetadata
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [rows, hidden] (the embeddings, overwritten) -> (the last layer's output, the residual
        stream), both [rows, hidden], as the layer loop of ``DecoderForCausalLM.forward`` returns them."""
        rows, size = hidden.shape
        hq, hkv, d, inter = self.num_heads, self.num_kv_heads, self.head_dim, self.inter

        def buffer(width: int) -> torch.Tensor:
            return torch.empty((rows, width), dtype=hidden.dtype)
        bufs = [buffer(w) for w in (size, size, size, (hq + 2 * hkv) * d, (hq + hkv) * d, hq * d, size,
                                    2 * inter, inter)]
        residual = bufs[0]
        k_cache = kv_cache.data[0, 0]
        tables, lens, slots = meta.block_tables, meta.seq_lens_k, meta.slot_mapping
        cos, sin = rope.cos.contiguous(), rope.sin.contiguous()
        step = cpu_layers.StepArgs(
            rows, size, hq, hkv, d, inter, self.eps, cpu_layers.DTYPE_CODES[hidden.dtype], torch.get_num_threads(),
            cpu_decode.CACHE_CODES[kv_cache.data.dtype],
            k_cache.shape[0], k_cache.shape[1], *k_cache.stride()[:3],
            tables.data_ptr(), lens.data_ptr(), slots.data_ptr(), tables.stride(0), cos.data_ptr(), sin.data_ptr(),
            hidden.data_ptr(), *(b.data_ptr() for b in bufs))
        cpu_layers.decode_layers(self._prepare(kv_cache, hidden.dtype), step)   # takes() said it is not None
        return hidden, residual


def _layer_qualifies(layer, dtype: torch.dtype) -> bool:
    from .decoder import DecoderLayer, DecoderMLP

    if type(layer) is not DecoderLayer or type(layer.mlp) is not DecoderMLP or layer.mlp.act is not silu_and_mul:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    return (attn.q_norm is None and attn.attn.logit_softcap is None and attn.head_dim % 16 == 0
            and attn.o_proj.bias is None and mlp.gate_up_proj.bias is None and mlp.down_proj.bias is None
            and all(isinstance(lin.packed_weight, cpu_gemm.TilePackedWeight) and lin.packed_weight.data.dtype == dtype
                    for lin in linears))


def build(model, enabled: bool) -> CpuDecodeLayers | None:
    """The one-call path for ``model`` (weights loaded and packed), or None where it does not qualify."""
    from .decoder import DecoderForCausalLM

    dtype = model.embed_tokens.weight.dtype
    if (not enabled or type(model).forward is not DecoderForCausalLM.forward or model.tp.world_size != 1
            or model.embed_tokens.weight.device.type != "cpu" or not cpu_layers.available(dtype)
            or not all(_layer_qualifies(layer, dtype) for layer in model.layers)):
        return None
    return CpuDecodeLayers(model)
