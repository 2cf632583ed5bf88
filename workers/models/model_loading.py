"""Loading one model's shard on a rank: checkpoint -> parallel layers -> (CPU) packed weights.

Used for the target model (``Worker``) and for the draft model of speculative decoding
(``draft_model.DraftModel``), so both read, shard, quantize and pack their weights the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..contract.config import ModelConfig
from ..kv_cache import KVCache, KVCacheSpec
from ..layers.gemm_timing import plan_table
from ..layers.packed_gemm import PackReport, pack_linear_weights, packed_gemm_available
from ..tp_group import TPGroup
from ..weights.quantization import WeightQuantization, keeps_packed
from ..weights.quantization import resolve as resolve_quantization
from ..weights.weight_loader import CheckpointReader
from . import cpu_decode_layers
from .decoder import DecoderForCausalLM
from .registry import model_class

log = logging.getLogger(__name__)


def load_model(model_path: str, hf_config, quantization_option: str, dtype: torch.dtype, device: torch.device,
               max_model_len: int, join_tp: Callable[[], TPGroup]
               ) -> tuple[DecoderForCausalLM, TPGroup, WeightQuantization]:
    """This rank's shard of the model at ``model_path``, in eval mode. ``join_tp`` is called once the
    checkpoint is open (a rank with a broken checkpoint fails before the other ranks wait for it)."""
    quantization = resolve_quantization(hf_config, quantization_option)
    with CheckpointReader(model_path, quantization, keeps_packed(quantization, device)) as reader:
        tp = join_tp()
        model = model_class(hf_config)(hf_config, tp, dtype, device, max_model_len)
        model.load_weights(reader)
    unloaded = [name for name, param in model.named_parameters() if param.is_meta]
    if unloaded:   # a meta weight would compute garbage, not fail (F.linear accepts one)
        raise RuntimeError(f"model: parameters left unloaded: {', '.join(unloaded[:4])}")
    return model.eval(), tp, quantization


def kv_cache_spec(model: DecoderForCausalLM, block_size: int, cache_dtype: torch.dtype) -> KVCacheSpec:
    """The KV cache this rank's ``model`` needs: one row per layer that holds KV (``num_kv_layers``: a hybrid's
    full-attention layers, Gemma 4's layers that do not read another layer's KV; else every layer), of its
    ``kv_layer_shapes`` (kv_heads_local, head_dim) where the model gives them and they differ (a tensor per
    shape: ``kv_cache.py``), else of ``num_local_kv_heads`` x ``dims.head_dim``."""
    shapes = tuple(getattr(model, "kv_layer_shapes", ()))
    layers = getattr(model, "num_kv_layers", model.dims.num_layers)
    if len(set(shapes)) > 1:
        return KVCacheSpec(layers, block_size, shapes[0][0], shapes[0][1], cache_dtype, layer_shapes=shapes)
    heads, dim = shapes[0] if shapes else (model.num_local_kv_heads, model.dims.head_dim)
    return KVCacheSpec(layers, block_size, heads, dim, cache_dtype)


def pack_for_cpu(model: DecoderForCausalLM, config: ModelConfig, max_num_seqs: int, dtype: torch.dtype,
                 device: torch.device) -> PackReport | None:
    """Packs the linear weights (``cpu_packed_weights``) for the product each row bucket measured fastest on
    this CPU (``layers/gemm_timing.py``; ``cpu_gemm`` forces one), and gives the model its one-call decode
    path where it qualifies (``models/cpu_decode_layers.py``; not with ``enforce_eager``), keeping the
    tile-packed copies that path reads. The pack report, or None when nothing was packed."""
    if not (config.cpu_packed_weights and device.type == "cpu" and packed_gemm_available(dtype)):
        return None
    table = plan_table(model, config.cpu_gemm, max_num_seqs)
    log.info("%s", table.format())
    one_call = cpu_decode_layers.qualifies(model, enabled=not config.enforce_eager)
    tiles = {id(lin) for lin in cpu_decode_layers.decoder_linears(model)} if one_call else set()
    report = pack_linear_weights(model, table.plan, lambda module: id(module) in tiles)
    model.cpu_decode = cpu_decode_layers.build(model, one_call, max_num_seqs)
    return PackReport(report.matrices, report.packed_bytes, report.weight_bytes, table)


def settle_cpu_decode(model: DecoderForCausalLM, kv_cache: KVCache, block_size: int) -> None:
    """Once the KV cache exists: times the one-call decode path against the layer loop where the measured
    plans made that a contest (``cpu_decode_layers.settle``); nothing to do otherwise."""
    if model.cpu_decode is not None and model.cpu_decode.contested:
        cpu_decode_layers.settle(model, kv_cache, block_size)
