"""Loading one model's shard on a rank: checkpoint -> parallel layers -> (CPU) packed weights.

Used for the target model (``Worker``) and for the draft model of speculative decoding
(``draft_model.DraftModel``), so both read, shard, quantize and pack their weights the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .layers.packed_gemm import PackReport, pack_linear_weights, packed_gemm_available
from .models import cpu_decode_layers
from .models.decoder import DecoderForCausalLM
from .models.registry import model_class
from .quantization import WeightQuantization, keeps_packed
from .quantization import resolve as resolve_quantization
from .tp_group import TPGroup
from .weight_loader import CheckpointReader


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


def pack_for_cpu(model: DecoderForCausalLM, enabled: bool, dtype: torch.dtype, device: torch.device,
                 enforce_eager: bool = False) -> PackReport | None:
    """Packs the linear weights for the CPU GEMM (``cpu_packed_weights``) where that pays, and gives the
    model its one-call decode path where it qualifies (``models/cpu_decode_layers.py``; not with
    ``enforce_eager``). The pack report, or None when nothing was packed."""
    if not (enabled and device.type == "cpu" and packed_gemm_available(dtype)):
        return None
    report = pack_linear_weights(model)
    model.cpu_decode = cpu_decode_layers.build(model, enabled=not enforce_eager)
    return report
