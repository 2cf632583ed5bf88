"""A decode step's dense decoder layers in one C call (``cpu_layers.c``), built on first use.

The C function calls the other CPU libraries' functions (``cpu_gemm`` or ``cpu_amx``, ``cpu_fused``, ``cpu_decode``)
through pointers, with the arguments their Python wrappers pass, so its result is bit for bit the
layer-by-layer path's; what it saves is the Python around them (~170 us a layer on the 2-core VM).
``available(dtype)`` is False when any of the four libraries is missing (no compiler, neither AVX-512
nor AVX2 + FMA for the GEMM, AVX512-BF16 for bfloat16, ``PAGEDRAY_CPU_KERNELS=0``). The model-side glue
(which models qualify, the per-step arguments) is ``workers/models/cpu_decode_layers.py``.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib

import torch

from . import cpu_amx, cpu_build, cpu_decode, cpu_fused, cpu_gemm, cpu_lora

SOURCE = pathlib.Path(__file__).with_name("cpu_layers.c")
DTYPE_CODES = cpu_build.DTYPE_CODES
_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class KernelTable(ctypes.Structure):
    _fields_ = [("norm", _P), ("rotary", _P), ("silu", _P), ("decode", _P), ("lora", _P)]


class LoraProj(ctypes.Structure):
    """One product's LoRA slots (``workers/lora/slots.LoraLinearSlots``: a, e, seg_off); a None: none."""
    _fields_ = [("a", _P), ("e", _P), ("seg_off", _P), ("nseg", _I64), ("nr", _I64)]


class LayerArgs(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _P), ("qkv_bias", _P), ("o", _P), ("gate_up", _P),
                ("down", _P), ("k_cache", _P), ("v_cache", _P), ("k_scale", _P), ("v_scale", _P), ("window", _I64),
                ("scale", _F32), ("k_static", ctypes.c_uint16), ("v_static", ctypes.c_uint16),
                ("lora", LoraProj * 4)]


class StepArgs(ctypes.Structure):
    _fields_ = [("rows", _I64), ("hidden", _I64), ("num_heads", _I64), ("num_kv_heads", _I64), ("head_dim", _I64),
                ("inter", _I64), ("eps", _F32), ("dtype", _INT), ("threads", _INT), ("cache_dtype", _INT),
                ("num_blocks", _I64), ("block_size", _I64), ("c_block", _I64), ("c_tok", _I64), ("c_head", _I64),
                ("block_tables", _P), ("seq_lens", _P), ("slots", _P), ("bt_row", _I64),
                ("cos", _P), ("signed_sin", _P),
                ("hidden_buf", _P), ("residual", _P), ("spare_residual", _P), ("normed", _P), ("qkv", _P),
                ("qk", _P), ("attn", _P), ("o", _P), ("gate_up", _P), ("act", _P),
                ("lora_order", _P), ("lora_slots", _P), ("lora_count", _I64), ("lora_scales", _P), ("gemm", _P)]


def _declare(library: ctypes.CDLL) -> None:
    library.decode_layers.argtypes = [ctypes.POINTER(KernelTable), ctypes.POINTER(LayerArgs), _I64,
                                      ctypes.POINTER(StepArgs)]
    library.decode_layers.restype = None


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return cpu_build.load(SOURCE, _declare, "CPU one-call decode layers", "decode steps run layer by layer")


def _address(function) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value


@functools.lru_cache(maxsize=1)
def kernel_table() -> KernelTable:
    """The other libraries' functions (call ``available`` first)."""
    fused, lora = cpu_fused._library(), cpu_lora._library()
    return KernelTable(_address(fused.rms_norm_rows),
                       _address(fused.rotary_rows), _address(fused.silu_mul_rows),
                       _address(cpu_decode._library().paged_decode_cpu),
                       None if lora is None else _address(lora.lora_add))


def gemm_address(product: str) -> int:
    """The address of the C function of ``product`` (``packed_gemm.TILE_PRODUCTS``: "c" or "amx") for
    ``StepArgs.gemm``; the caller has checked that the product is available."""
    if product == "amx":
        return _address(cpu_amx._library().amx_gemm)
    if product == "c":
        return _address(cpu_gemm._library().gemm)
    raise ValueError(f"product: the one call runs 'c' or 'amx', got {product!r}")


def takes_lora() -> bool:
    """True when the one call can add LoRA rows' products (``cpu_lora.c`` is built)."""
    return cpu_lora._library() is not None


def available(dtype: torch.dtype) -> bool:
    """True when this library and the four it calls are built for ``dtype`` (float32 / bfloat16) here."""
    return (dtype in DTYPE_CODES and cpu_gemm.available(dtype) and cpu_fused._library() is not None
            and cpu_decode.available() and _library() is not None)


def decode_layers(layers: ctypes.Array, step: StepArgs) -> None:
    """Runs ``cpu_layers.c``'s ``decode_layers`` over ``layers`` (a ``LayerArgs`` array) for ``step``; the
    caller (``workers/models/cpu_decode_layers.py``) has checked every pointer, shape and dtype."""
    _library().decode_layers(ctypes.byref(kernel_table()), layers, len(layers), ctypes.byref(step))
