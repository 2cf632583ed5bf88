"""bfloat16 linear layers on CPUs with AVX512-BF16, in C (``cpu_gemm.c``): y = x @ W^T (+ bias).

A decode step's linear layers stream every weight once per step; oneDNN's packed bf16 product read
them at ~27 GB/s on a 2-core EPYC, this loop at ~40 GB/s (its weights pair-packed once at load,
``pack_bf16``, the layout ``cpu_gemm.c`` describes). Products are float32 sums rounded once to bfloat16.

``available()`` is False where the compiler does not target AVX512-BF16, where the C build fails or
with ``PAGEDRAY_CPU_KERNELS=0`` (``cpu_build``); the layers then keep oneDNN's packed weights
(``workers/layers/packed_gemm.py`` chooses). Every argument is checked before the C call: a wrong one is
a ValueError naming it.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib
from typing import NamedTuple

import torch

from . import cpu_build

SOURCE = pathlib.Path(__file__).with_name("cpu_gemm.c")
TILE = 16                                      # output columns per packed tile (cpu_gemm.c)
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "pack_bf16_pairs": [_PTR, _I64, _I64, _PTR, _INT],
    "gemm_bf16": [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _INT],
}


class PairPackedWeight(NamedTuple):
    """A bfloat16 weight [out_features, in_features] pair-packed for ``linear_bf16``:
    data [ceil(out_features / 16), in_features / 2, 16, 2] bfloat16."""

    data: torch.Tensor
    out_features: int
    in_features: int


def _declare(library: ctypes.CDLL) -> None:
    library.gemm_bf16_supported.restype = _INT
    library.gemm_bf16_supported.argtypes = []
    if library.gemm_bf16_supported():
        for name, argtypes in _SIGNATURES.items():
            getattr(library, name).argtypes = argtypes
            getattr(library, name).restype = None


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    library = cpu_build.load(SOURCE, _declare, "CPU bf16 GEMM", "bf16 linear layers use oneDNN")
    return library if library is not None and library.gemm_bf16_supported() else None


def available() -> bool:
    """True when the C GEMM is built for this CPU (AVX512-BF16)."""
    return _library() is not None


def packable(weight: torch.Tensor) -> bool:
    """A 2-D bfloat16 CPU weight with an even number of input columns, and the GEMM available."""
    return (isinstance(weight, torch.Tensor) and weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and weight.dim() == 2 and weight.shape[1] % 2 == 0 and weight.shape[1] > 0 and available())


def pack_bf16(weight: torch.Tensor) -> PairPackedWeight:
    """weight [out, in] bfloat16 on CPU (in even) -> its pair-packed copy."""
    if not packable(weight):
        raise ValueError(f"weight: pair packing needs a 2-D bfloat16 CPU tensor with an even, non-zero number "
                         f"of columns and a CPU with AVX512-BF16, got {tuple(weight.shape)} {weight.dtype} "
                         f"on {weight.device}")
    out_features, in_features = weight.shape
    weight = weight.detach().contiguous()
    data = torch.empty(((out_features + TILE - 1) // TILE, in_features // 2, TILE, 2), dtype=torch.bfloat16)
    _library().pack_bf16_pairs(weight.data_ptr(), out_features, in_features, data.data_ptr(),
                               torch.get_num_threads())
    return PairPackedWeight(data, out_features, in_features)


def _check(x: torch.Tensor, packed: PairPackedWeight, bias: torch.Tensor | None) -> None:
    if not isinstance(packed, PairPackedWeight):
        raise ValueError(f"packed: expected a PairPackedWeight from pack_bf16, got {type(packed).__name__}")
    if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.dtype != torch.bfloat16 or x.dim() < 1:
        raise ValueError(f"x: expected a bfloat16 CPU tensor [..., {packed.in_features}], got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    if x.shape[-1] != packed.in_features:
        raise ValueError(f"x: last dimension {x.shape[-1]} is not the weight's {packed.in_features} input features")
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.device.type != "cpu"
                             or tuple(bias.shape) != (packed.out_features,)):
        raise ValueError(f"bias: expected bfloat16 [{packed.out_features}] on CPU, got {bias.dtype} "
                         f"{tuple(bias.shape)} on {bias.device}")


def linear_bf16(x: torch.Tensor, packed: PairPackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] bfloat16 -> x @ W^T (+ bias) [..., out] bfloat16."""
    _check(x, packed, bias)
    rows = x.reshape(-1, packed.in_features)
    if rows.stride(1) != 1 or rows.stride(0) % 2 or rows.data_ptr() % 4:   # rows read as 32-bit pairs
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], packed.out_features), dtype=torch.bfloat16)
    if rows.shape[0]:
        bias = None if bias is None else bias.contiguous()
        _library().gemm_bf16(rows.data_ptr(), rows.stride(0), rows.shape[0], packed.in_features,
                             packed.data.data_ptr(), packed.out_features, None if bias is None else bias.data_ptr(),
                             out.data_ptr(), out.stride(0), torch.get_num_threads())
    return out.reshape(*x.shape[:-1], packed.out_features)
