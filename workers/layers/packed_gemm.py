"""CPU fp32 linear layers over weights pre-packed once for MKL's GEMM (``cblas_sgemm_pack``).

``F.linear`` on CPU hands the weight to MKL's sgemm, which re-packs the whole weight into its
internal panel layout on every call: at decode sizes (16 rows x 576 features for SmolLM2) that
copy costs as much as the product. Packing each weight once at load time
(``torch.ops.mkl._mkl_reorder_linear_weight``) and multiplying with ``torch.ops.mkl._mkl_linear``
(``cblas_sgemm_compute``) removes it.

Decisions:
- Used where it is faster: fp32 on CPU, for products of ``PACKED_ROWS`` (4 to 16) rows, i.e. decode
  batches of 4-16 sequences. Measured on the 2-core VM (cold weights, 1 and 2 threads, SmolLM2's
  shapes): packed / ``F.linear`` time 0.6-0.9 at 4-16 rows, ~1.0 at 1-2 rows, and 0.9-1.4 from 17
  rows up (2.5x slower for the LM head at 512 rows): MKL's plain sgemm is the better kernel there.
- Numerics: at 16 rows the packed product was bit-identical to ``F.linear`` in every shape we
  checked; at 4-15 rows it differs in the last bits, as ``F.linear`` itself does between row counts
  (its results for a row depend on how many rows share the call). Greedy tokens still equal
  transformers' (the HF-exact tests run with packing on); batch-1 decode, which is what
  ``generate`` runs, stays on ``F.linear``.
- Memory: the packed copy sits next to the plain weight, which products outside ``PACKED_ROWS`` and
  the tied embedding lookup still read. MKL's packed layout pads each matrix by a few MiB, so small
  models pay most: SmolLM2-135M's 538 MB of fp32 weights gain 1.98 GB of packed copies; large
  matrices gain ~1.1-1.3x their size. ``ModelConfig.cpu_packed_weights=False`` turns it off.
- The two ops are torch's private MKL bindings (what inductor's CPU weight freezing uses). When
  torch was built without them (no MKL, another CPU architecture) ``packed_gemm_available()`` is
  False and every layer runs ``F.linear``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

PACKED_ROWS = range(4, 17)   # products with this many rows use the packed weight (module docstring)
PACK_HINT_ROWS = 16


def packed_gemm_available() -> bool:
    """True when this torch has MKL and its packed-GEMM ops."""
    mkl = getattr(torch.ops, "mkl", None)
    return (torch.backends.mkl.is_available() and mkl is not None
            and hasattr(mkl, "_mkl_reorder_linear_weight") and hasattr(mkl, "_mkl_linear"))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] fp32 on CPU -> MKL's packed copy of it (opaque, 1-D)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        raise ValueError(f"weight: packing needs a 2-D float32 CPU tensor, got {tuple(weight.shape)} "
                         f"{weight.dtype} on {weight.device}")
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach().contiguous(), PACK_HINT_ROWS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] -> [rows, out]: the packed product for rows in PACKED_ROWS, else F.linear."""
    if packed is not None and x.dim() == 2 and x.shape[0] in PACKED_ROWS:
        return torch.ops.mkl._mkl_linear(x.contiguous(), packed, weight, bias, x.shape[0])
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
        if hasattr(module, "packed_weight"):
            module.packed_weight = pack_weight(module.weight)
            matrices += 1
            packed_bytes += module.packed_weight.numel() * module.packed_weight.element_size()
            weight_bytes += module.weight.numel() * module.weight.element_size()
    return PackReport(matrices, packed_bytes, weight_bytes)
