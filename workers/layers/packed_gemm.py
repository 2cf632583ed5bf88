"""CPU linear layers over weights packed once at load, each row count on the product measured fastest here.

``F.linear`` on CPU hands an fp32 weight to MKL's sgemm and a bf16 one to oneDNN, and both re-lay the
whole weight out on every call. Four products can run a layer instead (``PRODUCTS``):

- ``c``: pagedray's C GEMM (``kernels.cpu_gemm``, AVX-512 or AVX2; bf16 needs AVX512-BF16) on a tile-packed copy;
- ``amx`` (bfloat16, on a CPU with AMX): pagedray's AMX product (``kernels.cpu_amx``) on the same tile-packed
  copy (``TILE_PRODUCTS``: the products the one-call decode path can run);
- ``onednn``: oneDNN's packed product (``torch.ops.mkldnn._linear_pointwise``) on a copy reordered once
  into its blocked layout (no batch-size hint, so one copy serves every row count); AMX where the CPU
  has it;
- ``mkl`` (float32 only): ``F.linear`` on the plain weight, MKL's sgemm.

Which one a layer runs is chosen per row bucket (``kernels.cpu_choice.ROW_BUCKETS``) by timing them on the
model's own weight shapes on this CPU (``gemm_timing``), or forced (``cpu_gemm`` option,
``PAGEDRAY_CPU_GEMM``). A layer's ``PackedLinear`` holds its plan and only the packed copies its plan uses.

Decisions: docs/design/workers.md, ``pagedray.workers.layers.packed_gemm``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pagedray.kernels.cpu import cpu_amx, cpu_gemm
from pagedray.kernels.cpu.cpu_choice import ROW_BUCKETS, bucket_index
from torch import nn

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
PRODUCTS = ("c", "amx", "onednn", "mkl")
TILE_PRODUCTS = ("c", "amx")          # the C products on the tile-packed copy


def packed_gemm_available(dtype: torch.dtype) -> bool:
    """True when this torch has oneDNN and its packed-linear ops, and this CPU can run them in dtype."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if (dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available() or mkldnn is None
            or not hasattr(mkldnn, "_reorder_linear_weight") or not hasattr(mkldnn, "_linear_pointwise")):
        return False
    return dtype != torch.bfloat16 or bool(mkldnn._is_mkldnn_bf16_supported())


def candidates(weight: torch.Tensor) -> tuple[str, ...]:
    """The products that can run ``weight`` [out, in] on this CPU, in preference order for ties."""
    out = []
    if cpu_gemm.packable(weight):
        out.append("c")
    if cpu_amx.takes(weight):
        out.append("amx")
    if packed_gemm_available(weight.dtype):
        out.append("onednn")
    if weight.dtype == torch.float32:
        out.append("mkl")
    return tuple(out)


@dataclass(frozen=True)
class PackedLinear:
    """A weight's packed copies and the product each row bucket runs (``plan[i]`` for ``ROW_BUCKETS[i]``)."""

    plan: tuple[str, ...]
    tile: cpu_gemm.TilePackedWeight | None = None     # for "c" and "amx"
    onednn: torch.Tensor | None = None                # for "onednn": oneDNN's opaque copy, [out, in]

    def product(self, rows: int) -> str:
        return self.plan[bucket_index(rows)]

    @property
    def packed_bytes(self) -> int:
        copies = [c for c in (None if self.tile is None else self.tile.data, self.onednn) if c is not None]
        return sum(c.numel() * c.element_size() for c in copies)

    def without_tile(self) -> PackedLinear:
        """The same without the tile-packed copy (for a plan that runs no ``TILE_PRODUCTS``)."""
        if set(self.plan) & set(TILE_PRODUCTS):
            raise ValueError(f"plan: {self.plan} still runs a product on the tile-packed copy")
        return PackedLinear(self.plan, None, self.onednn)


def pack_weight(weight: torch.Tensor, plan: tuple[str, ...] | str, keep_tile: bool = False) -> PackedLinear:
    """weight [out, in] fp32/bf16 on CPU -> the copies ``plan`` (one product, or one per row bucket) needs;
    ``keep_tile``: the tile-packed copy too (the one-call decode path reads it)."""
    if weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES or weight.dim() != 2:
        raise ValueError(f"weight: packing needs a 2-D float32 or bfloat16 CPU tensor, got "
                         f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
    plan = (plan,) * len(ROW_BUCKETS) if isinstance(plan, str) else tuple(plan)
    usable = candidates(weight)
    if len(plan) != len(ROW_BUCKETS) or any(p not in usable for p in plan):
        raise ValueError(f"plan: one of {usable} per row bucket ({len(ROW_BUCKETS)}) for a {weight.dtype} "
                         f"{tuple(weight.shape)} weight on this CPU, got {plan}")
    weight = weight.detach().contiguous()
    tile = cpu_gemm.pack(weight) if set(plan) & set(TILE_PRODUCTS) or (keep_tile and "c" in usable) else None
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight) if "onednn" in plan else None
    return PackedLinear(plan, tile, onednn)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedLinear | None) -> torch.Tensor:
    """x [..., in] -> [..., out]: the product the layer's plan names for x's row count, else F.linear."""
    if packed is None:
        return F.linear(x, weight, bias)
    product = packed.product(x.numel() // max(x.shape[-1], 1))
    if product == "c":
        return cpu_gemm.linear(x, packed.tile, bias)
    if product == "amx":
        return cpu_amx.linear(x, packed.tile, bias)
    if product == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")
    return F.linear(x, weight, bias)


def linear_silu_mul(x: torch.Tensor, bias: torch.Tensor | None, packed: PackedLinear | None) -> torch.Tensor | None:
    """x [..., in] through a merged gate/up weight [2 * inter, in] -> silu(gate) * up [..., inter] in one C pass
    (``cpu_gemm.silu_mul_linear`` / ``cpu_amx.silu_mul_linear``: the same bits as that product then
    ``kernels.silu_and_mul``) when the plan runs a C product at x's row count and the weight's halves start on
    a tile; else None (the caller multiplies and then applies the activation)."""
    if packed is None or packed.tile is None or not cpu_gemm.fuses_silu_mul(packed.tile.out_features):
        return None
    product = packed.product(x.numel() // max(x.shape[-1], 1))
    if product == "c":
        return cpu_gemm.silu_mul_linear(x, packed.tile, bias)
    if product == "amx":
        return cpu_amx.silu_mul_linear(x, packed.tile, bias)
    return None


@dataclass(frozen=True)
class PackReport:
    """What ``pack_linear_weights`` did: matrices packed, the bytes of their packed copies, and the plan
    table (``gemm_timing.PlanTable``) it followed."""

    matrices: int
    packed_bytes: int
    weight_bytes: int
    table: object = None


def packable_modules(model: nn.Module) -> list[nn.Module]:
    """The modules with a ``packed_weight`` slot and a dense weight (a quantized one is kept packed)."""
    return [m for m in model.modules() if hasattr(m, "packed_weight") and m.weight is not None]


def pack_linear_weights(model: nn.Module, plans, keep_tile=lambda module: False) -> PackReport:
    """Gives every packable module (the linear layers and the LM head) its ``PackedLinear``: ``plans(module)``
    is its plan; ``keep_tile(module)``: also its tile-packed copy. Call once, after the weights are loaded."""
    matrices = packed_bytes = weight_bytes = 0
    for module in packable_modules(model):
        module.packed_weight = pack_weight(module.weight, plans(module), keep_tile(module))
        matrices += 1
        packed_bytes += module.packed_weight.packed_bytes
        weight_bytes += module.weight.numel() * module.weight.element_size()
    return PackReport(matrices, packed_bytes, weight_bytes)
