"""The one-call CPU decode path of ``DecoderForCausalLM`` (``kernels/cpu/cpu_layers.c``): which models take
it, and the per-step arguments.

A decode step (every sequence schedules one token) of a qualifying model runs all its decoder layers in
one C call that makes, op for op, the calls the layer-by-layer path makes (bit for bit the same hidden
states); the embedding, the rotary tables and the final norm stay in Python. Why: at decode sizes the
Python around each layer's ~10 small calls (checks, allocations, ctypes, module dispatch) cost ~160-180 us a
layer on the 2-core VM, 5-6 ms of a 25 ms float32 SmolLM2 step at batch 16 (measured in
docs/design/workers.md).

Qualifies (checked once, when the weights are packed): CPU, TP = 1, float32 / bfloat16 with the C
libraries built, every layer a ``DecoderLayer`` with a SiLU MLP (no experts), no q/k norm, no attention
soft-capping, no bias but the qkv projection's, every linear weight tile-packable for ``cpu_gemm``, and the
model's own ``forward`` (Gemma's differs).

Which decode steps take it (``buckets``, by row bucket, ``kernels.cpu_choice``): the path runs one product
on the tile-packed weights per step (``products``: the C GEMM or, on a CPU with AMX, the AMX product;
``packed_gemm.TILE_PRODUCTS``), so where every decoder-layer weight's measured plan (``layers/gemm_timing.py``)
runs the same tile product at a bucket, the path runs what the layer loop would, minus the Python, and takes
that bucket with that product. A bucket where the plans run other products (oneDNN's, or the two tile
products mixed) is *contested*: the layer loop with those products against this path with the tile product
most of the plans run there (none: the AMX product where every weight takes it, else the C GEMM), decided
by timing a whole decode step both ways once the KV cache exists (``settle``), cached on disk like the GEMM
plans. The tile-packed copies are kept until then and
dropped where no bucket needs them. Per step: a KV cache in the model's dtype or of 8-bit rows (int8 or
float8) and a block size the decode kernel takes. ``enforce_eager`` turns the path off (the layer-by-layer
path, whose modules forward hooks can see, as CUDA's eager steps).
"""

from __future__ import annotations

import ctypes
import logging
import statistics
import time
from collections.abc import Callable

import torch
from pagedray.kernels.cpu import cpu_amx, cpu_choice, cpu_decode, cpu_gemm, cpu_layers
from pagedray.kernels.cpu.cpu_choice import ROW_BUCKETS, bucket_index
from pagedray.kernels.kv_quant import is_quantized

from ..kv_cache import KVCache
from ..layers.activation import silu_and_mul
from ..layers.attention import AttentionMetadata
from ..layers.packed_gemm import TILE_PRODUCTS
from ..layers.rotary import RotaryStep
from .decoder import DecoderForCausalLM, DecoderLayer, DecoderMLP

log = logging.getLogger(__name__)
TIMING_CONTEXT = 128      # tokens of context per sequence in ``settle``'s decode steps
TIMING_REPEATS = 3


class CpuDecodeLayers:
    """Built by ``build`` for a qualifying model; ``run`` takes a decode step's embeddings."""

    def __init__(self, model, max_rows: int) -> None:
        self.model = model
        last = bucket_index(max_rows)                # decode steps have at most max_num_seqs rows
        linears = decoder_linears(model)
        amx_takes_all = all(cpu_amx.takes(lin.weight) for lin in linears)
        self.products: dict[int, str] = {b: one_call_product([lin.packed_weight.plan[b] for lin in linears],
                                                             amx_takes_all) for b in range(last + 1)}
        self._gemm_address = {b: cpu_layers.gemm_address(p) for b, p in self.products.items()}   # StepArgs.gemm
        uncontested = {b for b in range(last + 1)
                       if all(lin.packed_weight.plan[b] == self.products[b] for lin in linears)}
        self.buckets: frozenset[int] = frozenset(uncontested)
        self.contested: frozenset[int] = frozenset(range(last + 1)) - self.buckets
        first = model.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.inter = model.layers[0].mlp.down_proj.cols
        self.eps = float(model.layers[0].input_layernorm.eps)
        self._layers: ctypes.Array | None = None
        self._cache_key: tuple | None = None
        linears = [lin for layer in model.layers for lin in _linears(layer)]
        self._lora_in_c = (model.lora is not None and cpu_layers.takes_lora()
                           and all(getattr(lin.lora, "in_c", False) for lin in linears))

    def takes(self, kv_cache: KVCache, hidden: torch.Tensor, meta: AttentionMetadata) -> bool:
        """True for a decode step (one token per sequence) over a cache this path can use (``_prepare``); a
        step with LoRA rows only where the call can add their products (every product's slots in C)."""
        lora = self.model.lora
        return (meta.max_query_len == 1 and hidden.shape[0] == meta.seq_lens_k.shape[0]
                and (lora is None or not lora.batch.groups or self._lora_in_c)
                and bucket_index(hidden.shape[0]) in self.buckets and self._prepare(kv_cache, hidden.dtype) is not None)

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
                attn.qkv_proj.packed_weight.tile.data.data_ptr(), None if bias is None else bias.data_ptr(),
                attn.o_proj.packed_weight.tile.data.data_ptr(), mlp.gate_up_proj.packed_weight.tile.data.data_ptr(),
                mlp.down_proj.packed_weight.tile.data.data_ptr(), kv.k.data_ptr(), kv.v.data_ptr(),
                None if kv.k_scale is None else kv.k_scale.data_ptr(),
                None if kv.v_scale is None else kv.v_scale.data_ptr(),
                int(attn.attn.sliding_window or 0), float(attn.attn.scale),
                *cpu_decode.static_scale_bits(attn.attn.checkpoint_kv_scales if kv.k.dtype == torch.float8_e4m3fn
                                              else None),
                (cpu_layers.LoraProj * 4)(*(_lora_proj(lin) for lin in _linears(layer))))
        return array

    def forward_layers(self, hidden: torch.Tensor, rope: RotaryStep, kv_cache: KVCache, meta: AttentionMetadata
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
        step.gemm = self._gemm_address[bucket_index(rows)]
        lora = self.model.lora
        if lora is not None and lora.batch.groups:       # takes() checked that the call adds their products
            batch = lora.batch
            step.lora_order, step.lora_slots = batch.order.data_ptr(), batch.slots.data_ptr()
            step.lora_count, step.lora_scales = batch.order.numel(), batch.scales.data_ptr()
        cpu_layers.decode_layers(self._prepare(kv_cache, hidden.dtype), step)   # takes() said it is not None
        return hidden, residual


def one_call_product(plans: list[str], amx_takes_all: bool) -> str:
    """The tile product the one call runs at a bucket where the decoder's weights run ``plans`` (one product
    each): the tile product most of them run (ties: ``TILE_PRODUCTS`` order); where none runs one, the AMX
    product. The AMX product only where it takes every weight (``amx_takes_all``); else the C GEMM."""
    if not amx_takes_all:
        return "c"
    counts = {p: plans.count(p) for p in TILE_PRODUCTS}
    if not any(counts.values()):
        return "amx"
    return max(TILE_PRODUCTS, key=lambda p: (counts[p], -TILE_PRODUCTS.index(p)))


def _lora_proj(lin) -> cpu_layers.LoraProj:
    """The LoRA slots of one product for the C call (all None / 0 without slots)."""
    slots = lin.lora
    if slots is None:
        return cpu_layers.LoraProj()
    return cpu_layers.LoraProj(slots.a.data_ptr(), slots.e.data_ptr(), slots.seg_off.data_ptr(),
                               slots.seg_off.numel() - 1, slots.a.shape[1])


def _linears(layer) -> tuple:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _layer_qualifies(layer, dtype: torch.dtype) -> bool:
    if type(layer) is not DecoderLayer or type(layer.mlp) is not DecoderMLP or layer.mlp.act is not silu_and_mul:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    return (attn.q_norm is None and attn.attn.logit_softcap is None and attn.attn.sinks is None
            and attn.head_dim % 16 == 0
            and attn.o_proj.bias is None and mlp.gate_up_proj.bias is None and mlp.down_proj.bias is None
            and all(lin.weight is not None and lin.weight.dtype == dtype and cpu_gemm.packable(lin.weight)
                    for lin in _linears(layer)))


def qualifies(model, enabled: bool) -> bool:
    """Whether ``model`` (weights loaded, not yet packed) can take the one-call path (module docstring)."""
    dtype = model.embed_tokens.weight.dtype
    return (enabled and type(model).forward is DecoderForCausalLM.forward and model.tp.world_size == 1
            and model.embed_tokens.weight.device.type == "cpu" and cpu_layers.available(dtype)
            and all(_layer_qualifies(layer, dtype) for layer in model.layers))


def decoder_linears(model) -> list:
    """The linear modules the one-call path multiplies with (each needs its tile-packed copy)."""
    return [lin for layer in model.layers for lin in _linears(layer)]


def build(model, enabled: bool, max_rows: int) -> CpuDecodeLayers | None:
    """The one-call path for ``model`` (weights loaded and packed, every decoder linear with its tile-packed
    copy), or None where it does not qualify; ``max_rows``: the most sequences a decode step holds."""
    if not qualifies(model, enabled) or any(lin.packed_weight is None or lin.packed_weight.tile is None
                                            for lin in decoder_linears(model)):
        return None
    return CpuDecodeLayers(model, max_rows)


def _timing_batch(rows: int, block_size: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input ids, positions, metadata) of a decode step of ``rows`` sequences of ``TIMING_CONTEXT`` tokens,
    each computing its last one (block ids wrap around the cache: the values computed do not matter, only
    the time); what ``runner.input_batch`` would build for such a step."""
    per_seq = -(-TIMING_CONTEXT // block_size)
    tables = (torch.arange(rows * per_seq, dtype=torch.int32) % num_blocks).view(rows, per_seq)   # [rows, per_seq]
    last = TIMING_CONTEXT - 1
    positions = torch.full((rows,), last, dtype=torch.int32)                                     # [rows]
    meta = AttentionMetadata(slot_mapping=tables[:, last // block_size] * block_size + last % block_size,
                             cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32),
                             seq_lens_k=positions + 1, block_tables=tables, max_query_len=1)
    return torch.ones(rows, dtype=torch.int32), positions, meta


def settle(model, kv_cache: KVCache, block_size: int, cache: cpu_choice.ChoiceCache | None = None,
           timer: Callable[[], float] = time.perf_counter, repeats: int = TIMING_REPEATS) -> dict[int, dict]:
    """Decides the contested buckets of ``model.cpu_decode`` by timing a whole decode step (``model.forward``)
    through the one call and through the layer loop, alternately, on ``kv_cache`` before it holds anything
    (the steps write into its blocks). The path takes a bucket where it was no slower. Where it takes none,
    ``model.cpu_decode`` becomes None and the tile-packed copies no plan runs are dropped. Returns
    bucket -> {"one_call_ms", "layer_loop_ms"} (empty when nothing was contested)."""
    path = model.cpu_decode
    if path is None or not path.contested:
        return {}
    cache = cpu_choice.ChoiceCache() if cache is None else cache
    dims = (len(model.layers), path.num_heads, path.num_kv_heads, path.head_dim, path.inter)
    plans = sorted({lin.packed_weight.plan for lin in decoder_linears(model)})
    name = (f"one-call decode {str(model.embed_tokens.weight.dtype).removeprefix('torch.')} dims={dims} "
            f"cache={str(kv_cache.data.dtype).removeprefix('torch.')} threads={torch.get_num_threads()} plans={plans}")
    stored = cache.get(name) or {}
    results, num_blocks, buckets, timed = {}, kv_cache.data.shape[2], path.buckets, False
    for bucket in sorted(path.contested):
        if isinstance(stored.get(str(bucket)), dict):
            results[bucket] = stored[str(bucket)]
            continue
        timed = True
        input_ids, positions, meta = _timing_batch(ROW_BUCKETS[bucket], block_size, num_blocks)
        times = {True: [], False: []}
        try:
            with torch.inference_mode():
                for round_ in range(repeats + 1):
                    for one_call in ((True, False) if round_ % 2 else (False, True)):
                        model.cpu_decode, path.buckets = (path if one_call else None), frozenset({bucket})
                        start = timer()
                        model(input_ids, positions, kv_cache, meta)
                        if round_:     # round 0 warms up
                            times[one_call].append((timer() - start) * 1e3)
        finally:
            model.cpu_decode, path.buckets = path, buckets
        results[bucket] = {"one_call_ms": statistics.median(times[True]),
                           "layer_loop_ms": statistics.median(times[False])}
    if timed:       # nothing to keep (and no busy machine to report) when every bucket came from the cache
        cache.put({name: {str(b): r for b, r in results.items()}})
    won = {b for b, r in results.items() if r["one_call_ms"] <= r["layer_loop_ms"]}
    path.buckets, path.contested = frozenset((path.buckets - path.contested) | won), frozenset()
    for bucket, r in sorted(results.items()):
        log.info("decode steps of %d rows: one call (%s) %.2f ms, layer loop (measured plan) %.2f ms: %s",
                 ROW_BUCKETS[bucket], path.products[bucket], r["one_call_ms"], r["layer_loop_ms"],
                 "one call" if bucket in won else "layer loop")
    if not path.buckets:
        model.cpu_decode = None
        for lin in decoder_linears(model):
            if not set(lin.packed_weight.plan) & set(TILE_PRODUCTS):
                lin.packed_weight = lin.packed_weight.without_tile()
    return results
