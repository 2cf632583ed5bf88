"""The bfloat16 linear layers through the AMX tiles (``cpu_amx.c``), on the tile-packed weights of ``cpu_gemm``.

A second C product for the CPUs that have AMX (Intel Xeon from Sapphire Rapids on): on such a CPU the
AVX-512 loop of ``cpu_gemm.c`` slows with the row count (2x its 1-row time at 16 rows, 11x oneDNN's AMX
product at 2,048), while this one multiplies 16 rows for the cost of one. It reads the same packed copy,
so the one-call decode path (``cpu_layers.c``) can run it too. Which product a layer runs at each row
count is measured at load (``workers/layers/gemm_timing.py``): this module only says whether it can run.

``available()`` is False where the compiler does not target AMX-BF16, where Linux refuses the process the
tile state, where the C build fails or with ``PAGEDRAY_CPU_KERNELS=0``. ``takes(weight)``: a bfloat16 weight
whose input width is a multiple of 32 (whole tile products), the C GEMM's packing available. Every argument
is checked before the C call: a wrong one is a ValueError naming it.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib

import torch

from . import cpu_build, cpu_gemm

SOURCE = pathlib.Path(__file__).with_name("cpu_amx.c")
K_MULTIPLE = 32                     # input columns per tile product (cpu_amx.c: PAIRS pairs)
_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {"amx_gemm": [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _INT, _INT],
               "amx_gemm_silu_mul": [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _INT, _INT]}


def _declare(library: ctypes.CDLL) -> None:
    library.amx_ready.restype = _INT
    library.amx_ready.argtypes = []
    if library.amx_ready():              # else the library has no other function
        cpu_build.declare(library, _SIGNATURES)


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return cpu_build.load(SOURCE, _declare, "AMX GEMM", "bfloat16 layers keep the other products")


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when this CPU, its kernel and the build let the AMX product run here (module docstring)."""
    library = _library()
    return library is not None and bool(library.amx_ready()) and cpu_gemm.available(torch.bfloat16)


def takes(weight: torch.Tensor) -> bool:
    """True for a weight [out, in] the AMX product can run here: tile-packable bfloat16, in a multiple of 32."""
    return (isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[1] % K_MULTIPLE == 0 and cpu_gemm.packable(weight) and available())


def _check(x: torch.Tensor, packed: cpu_gemm.TilePackedWeight, bias: torch.Tensor | None,
           fused: bool = False) -> None:
    """The arguments first, then whether this CPU can run it: a bad argument is named on every CPU."""
    cpu_gemm.check(x, packed, bias)
    if packed.data.dtype != torch.bfloat16 or packed.in_features % K_MULTIPLE:
        raise ValueError(f"packed: the AMX product takes a bfloat16 weight with a multiple of {K_MULTIPLE} input "
                         f"features, got {packed.data.dtype} with {packed.in_features}")
    if fused:
        cpu_gemm.check_fused(packed)
    if not available():
        raise ValueError("packed: the AMX product cannot run on this CPU (no AMX-BF16, or the tile state refused)")


def linear(x: torch.Tensor, packed: cpu_gemm.TilePackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] bfloat16 -> x @ W^T (+ bias) [..., out] bfloat16."""
    _check(x, packed, bias)
    return cpu_gemm.multiply(_library().amx_gemm, x, packed, bias, packed.out_features)


def silu_mul_linear(x: torch.Tensor, packed: cpu_gemm.TilePackedWeight, bias: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """x [..., in], packed W [2 * inter, in] (gate rows, then up rows) -> silu(gate) * up [..., inter], each sum
    rounded to bfloat16 first, in one pass (as ``cpu_gemm.silu_mul_linear``)."""
    _check(x, packed, bias, fused=True)
    return cpu_gemm.multiply(_library().amx_gemm_silu_mul, x, packed, bias, packed.out_features // 2)

