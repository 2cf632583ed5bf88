"""The CPU linear layers in C (``cpu_gemm.c``): y = x @ W^T (+ bias), float32 (AVX-512, or AVX2 with FMA) or
bfloat16 (AVX512-BF16).

A decode step's linear layers stream every weight once per step; oneDNN's packed bf16 product read
them at ~27 GB/s on a 2-core EPYC, this loop at ~40 GB/s (its weights tile-packed once at load,
``pack``, the layout ``cpu_gemm.c`` describes). Sums are float32; bfloat16 outputs are rounded once. The
AVX2 build runs smaller blocks of rows and gives the same bits.

``available(dtype)`` is False where the compiler targets neither AVX-512 nor AVX2 with FMA (bfloat16:
AVX512-BF16), where
the C build fails or with ``PAGEDRAY_CPU_KERNELS=0`` (``cpu_build``); the layers then keep oneDNN's
packed weights (``workers/layers/packed_gemm.py`` chooses). Every argument is checked before the C
call: a wrong one is a ValueError naming it.
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
DTYPE_CODES = cpu_build.DTYPE_CODES
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "pack_weight": [_PTR, _I64, _I64, _PTR, _INT, _INT],
    "gemm": [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _INT, _INT],
    "gemm_silu_mul": [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _INT, _INT],
}


class TilePackedWeight(NamedTuple):
    """A weight [out_features, in_features] tile-packed for ``linear``: data float32 [ceil(out / 16), in, 16]
    or bfloat16 [ceil(out / 16), in / 2, 16, 2] (cpu_gemm.c)."""

    data: torch.Tensor
    out_features: int
    in_features: int


def _declare(library: ctypes.CDLL) -> None:
    library.gemm_supported.restype = _INT
    library.gemm_supported.argtypes = [_INT]
    if library.gemm_supported(DTYPE_CODES[torch.float32]):   # else the library has no other function
        cpu_build.declare(library, _SIGNATURES)


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return cpu_build.load(SOURCE, _declare, "CPU GEMM", "linear layers use oneDNN")


@functools.lru_cache(maxsize=None)
def available(dtype: torch.dtype) -> bool:
    """True when the C GEMM is built for this CPU in ``dtype`` (float32: AVX512F or AVX2 + FMA; bfloat16:
    AVX512-BF16)."""
    library = _library()
    return dtype in DTYPE_CODES and library is not None and bool(library.gemm_supported(DTYPE_CODES[dtype]))


def packable(weight: torch.Tensor) -> bool:
    """A 2-D float32 / bfloat16 CPU weight (bfloat16: an even number of input columns), the GEMM available."""
    return (isinstance(weight, torch.Tensor) and weight.device.type == "cpu" and weight.dim() == 2
            and weight.dtype in DTYPE_CODES and weight.shape[1] > 0
            and (weight.dtype != torch.bfloat16 or weight.shape[1] % 2 == 0) and available(weight.dtype))


def pack(weight: torch.Tensor) -> TilePackedWeight:
    """weight [out, in] float32 / bfloat16 on CPU -> its tile-packed copy."""
    if not packable(weight):
        raise ValueError(f"weight: tile packing needs a 2-D float32 or bfloat16 (even number of columns) CPU "
                         f"tensor and a CPU with AVX-512 or AVX2 (bfloat16: AVX512-BF16), got {tuple(weight.shape)} "
                         f"{weight.dtype} on {weight.device}")
    out_features, in_features = weight.shape
    weight = weight.detach().contiguous()
    tiles = (out_features + TILE - 1) // TILE
    shape = (tiles, in_features // 2, TILE, 2) if weight.dtype == torch.bfloat16 else (tiles, in_features, TILE)
    data = torch.empty(shape, dtype=weight.dtype)
    _library().pack_weight(weight.data_ptr(), out_features, in_features, data.data_ptr(),
                           DTYPE_CODES[weight.dtype], torch.get_num_threads())
    return TilePackedWeight(data, out_features, in_features)


def check(x: torch.Tensor, packed: TilePackedWeight, bias: torch.Tensor | None) -> None:
    """A ValueError naming the argument unless x [..., in], ``packed`` and ``bias`` fit one product."""
    if not isinstance(packed, TilePackedWeight):
        raise ValueError(f"packed: expected a TilePackedWeight from pack, got {type(packed).__name__}")
    dtype = packed.data.dtype
    if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.dtype != dtype or x.dim() < 1:
        raise ValueError(f"x: expected a {dtype} CPU tensor [..., {packed.in_features}], got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    if x.shape[-1] != packed.in_features:
        raise ValueError(f"x: last dimension {x.shape[-1]} is not the weight's {packed.in_features} input features")
    if bias is not None and (bias.dtype != dtype or bias.device.type != "cpu"
                             or tuple(bias.shape) != (packed.out_features,)):
        raise ValueError(f"bias: expected {dtype} [{packed.out_features}] on CPU, got {bias.dtype} "
                         f"{tuple(bias.shape)} on {bias.device}")


def _rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """x [..., in] as [rows, in] the kernels can read 4 bytes at a time (cpu_gemm.c)."""
    rows = x.reshape(-1, in_features)
    if rows.stride(1) != 1 or (rows.stride(0) * rows.element_size()) % 4 or rows.data_ptr() % 4:
        rows = rows.contiguous()
    return rows


def multiply(function, x: torch.Tensor, packed: TilePackedWeight, bias: torch.Tensor | None, width: int
             ) -> torch.Tensor:
    """x [..., in] through ``function``, a C product with ``gemm``'s signature on tile-packed weights (this
    library's ``gemm`` / ``gemm_silu_mul``, ``cpu_amx``'s), which writes ``width`` outputs per row -> [..., width].
    The caller has checked the arguments (``check``, and what its product needs beyond it)."""
    rows = _rows(x, packed.in_features)
    out = torch.empty((rows.shape[0], width), dtype=x.dtype)
    if rows.shape[0]:
        bias = None if bias is None else bias.contiguous()
        function(rows.data_ptr(), rows.stride(0), rows.shape[0], packed.in_features, packed.data.data_ptr(), width,
                 None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), DTYPE_CODES[x.dtype],
                 torch.get_num_threads())
    return out.reshape(*x.shape[:-1], width)


def linear(x: torch.Tensor, packed: TilePackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> x @ W^T (+ bias) [..., out], in the weight's dtype."""
    check(x, packed, bias)
    return multiply(_library().gemm, x, packed, bias, packed.out_features)


def fuses_silu_mul(out_features: int) -> bool:
    """Whether ``silu_mul_linear`` takes a merged gate/up weight of ``out_features`` rows: its halves must start on
    a tile (out_features = 2 * inter, inter a multiple of 16)."""
    return out_features % (2 * TILE) == 0


def silu_mul_linear(x: torch.Tensor, packed: TilePackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in], packed W [2 * inter, in] (the gate's rows, then the up rows) -> silu(gate) * up [..., inter]:
    the bits of ``linear`` followed by ``cpu_fused.silu_and_mul_cpu``, in one pass that never writes the
    [rows, 2 * inter] product."""
    check(x, packed, bias)
    check_fused(packed)
    return multiply(_library().gemm_silu_mul, x, packed, bias, packed.out_features // 2)


def check_fused(packed: TilePackedWeight) -> None:
    """(after ``check``) A ValueError unless ``packed`` is a merged gate/up weight a fused product takes
    (``fuses_silu_mul``)."""
    if not fuses_silu_mul(packed.out_features):
        raise ValueError(f"packed: a fused gate/up product needs out_features = 2 * inter with inter a multiple of "
                         f"{TILE}, got {packed.out_features}")
