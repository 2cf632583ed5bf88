"""CPU linear layers over weights pre-packed once: for pagedray's bf16 GEMM or for oneDNN's (fp32, bf16).

``F.linear`` on CPU hands an fp32 weight to MKL's sgemm and a bf16 one to oneDNN, and both re-lay
the whole weight out on every call. Packing each weight once at load time into oneDNN's blocked
layout (``torch.ops.mkldnn._reorder_linear_weight``, no batch-size hint, so one packed copy serves
every row count) and multiplying with ``torch.ops.mkldnn._linear_pointwise`` removes that.

bfloat16 weights on a CPU with AVX512-BF16 are tile-packed for ``kernels.cpu_gemm`` instead (its C loop
streams the weights ~1.5x faster than oneDNN at decode sizes and was no slower up to 1,024 rows,
docs/design/kernels.md); the layer holds one packed copy either way.

Decisions: docs/design/workers.md, ``pagedray.workers.layers.packed_gemm``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pagedray.kernels import cpu_gemm
from torch import nn

PackedWeight = torch.Tensor | cpu_gemm.TilePackedWeight     # oneDNN's opaque copy, or tile-packed bf16

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def packed_gemm_available(dtype: torch.dtype) -> bool:
    """True when this torch has oneDNN and its packed-linear ops, and this CPU can run them in dtype."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if (dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available() or mkldnn is None
            or not hasattr(mkldnn, "_reorder_linear_weight") or not hasattr(mkldnn, "_linear_pointwise")):
        return False
    return dtype != torch.bfloat16 or bool(mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor) -> PackedWeight:
    """weight [out, in] fp32/bf16 on CPU -> its tile-packed copy (bf16 where ``cpu_gemm`` runs) or
    oneDNN's packed copy (opaque mkldnn tensor, [out, in])."""
    if weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES or weight.dim() != 2:
        raise ValueError(f"weight: packing needs a 2-D float32 or bfloat16 CPU tensor, got "
                         f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
    if cpu_gemm.packable(weight):
        return cpu_gemm.pack(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedWeight | None) -> torch.Tensor:
    """x [..., in] -> [..., out]: the packed product when the layer has a packed weight, else F.linear."""
    if isinstance(packed, cpu_gemm.TilePackedWeight):
        return cpu_gemm.linear(x, packed, bias)
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


@dataclass(frozen=True)
class PackReport:
    """What ``pack_linear_weights`` did: matrices packed and the bytes their packed copies take."""

    matrices: int
    packed_bytes: int
    weight_bytes: int


def pack_linear_weights(model: nn.Module) -> PackReport:
    """Gives every module with a ``packed_weight`` slot (the linear layers and the LM head) its packed
    weight. Call once, after the weights are loaded; a later weight change needs a new call."""
    matrices = packed_bytes = weight_bytes = 0
    for module in model.modules():
        if hasattr(module, "packed_weight") and module.weight is not None:   # None: kept quantized
            module.packed_weight = pack_weight(module.weight)
            packed = module.packed_weight
            data = packed.data if isinstance(packed, cpu_gemm.TilePackedWeight) else packed
            matrices += 1
            packed_bytes += data.numel() * data.element_size()
            weight_bytes += module.weight.numel() * module.weight.element_size()
    return PackReport(matrices, packed_bytes, weight_bytes)
