"""Small decoder ops on CPU in C (``cpu_fused.c``): RMSNorm with the residual add, rotary, SiLU * up, and the
store of a step's keys and values into a cache of their dtype.

On CPU these ran as torch ops (``reference.fused``): 4-9 small ops per call, 91 calls per decode step
of SmolLM2, where each op's dispatch costs as much as its arithmetic at decode sizes. One C call each
does the same arithmetic, op for op (``cpu_fused.c`` says where it can differ: the order of the sum of
squares, in the last bit of float32).

SiLU * up stays a torch op: the same kind of C loop was slower than torch's vectorised ``silu``
(docs/design/kernels.md has the measurements).

``fused_ops`` calls these for CPU tensors that ``supports_*`` accepts (float32 / bfloat16, the layouts
the decoder passes) when the library is built (``cpu_build``: the machine's C compiler, cached; with
``PAGEDRAY_CPU_KERNELS=0`` or no compiler the torch references run). Arguments are validated by the
callers in ``fused_ops``; shapes in the docstrings below.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib

import torch

from . import cpu_build

SOURCE = pathlib.Path(__file__).with_name("cpu_fused.c")
DTYPE_CODES = cpu_build.DTYPE_CODES
_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "rms_norm_rows": [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _F32, _INT, _INT],
    "rotary_rows": [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _INT, _INT],
    "silu_mul_rows": [_PTR, _I64, _PTR, _I64, _I64, _I64, _INT, _INT],
    "store_kv_rows": [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64],
}


def _declare(library: ctypes.CDLL) -> None:
    cpu_build.declare(library, _SIGNATURES)


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return cpu_build.load(SOURCE, _declare, "CPU fused ops", "RMSNorm and rotary run as torch ops")


def _rows_ok(*tensors: torch.Tensor) -> bool:
    """CPU, float32/bfloat16, rank 2, last dim contiguous, all of one dtype."""
    first = tensors[0]
    return all(t.device.type == "cpu" and t.dtype == first.dtype and t.dim() == 2 and t.stride(1) == 1
               for t in tensors) and first.dtype in DTYPE_CODES


def supports_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor | None) -> bool:
    others = [t for t in (residual, out) if t is not None]
    return _rows_ok(x, *others) and _library() is not None


def supports_rotary(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """x [tokens, heads, D] with heads adjacent (head stride D); cos [tokens, 1, D] contiguous."""
    return (x.device.type == "cpu" and x.dtype in DTYPE_CODES and x.dim() == 3 and x.stride(2) == 1
            and x.stride(1) == x.shape[2] and cos.dtype == x.dtype and cos.is_contiguous()
            and tuple(cos.shape) == (x.shape[0], 1, x.shape[2]) and _library() is not None)


def rms_norm_cpu(x, weight, eps, residual=None, out=None):
    """x [rows, size] (+ residual [rows, size]) -> normed [rows, size], or (normed, x + residual);
    ``out`` (x's shape, may be x) receives the normed rows."""
    rows, size = x.shape
    normed = torch.empty((rows, size), dtype=x.dtype) if out is None else out
    new_residual = None if residual is None else torch.empty((rows, size), dtype=x.dtype)
    weight = weight.contiguous()
    _library().rms_norm_rows(
        x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0), weight.data_ptr(), normed.data_ptr(), normed.stride(0),
        None if new_residual is None else new_residual.data_ptr(), size, rows, size, float(eps),
        DTYPE_CODES[x.dtype], torch.get_num_threads())
    return normed if residual is None else (normed, new_residual)


def apply_rotary_cpu(x, cos, signed_sin):
    """x [tokens, heads, D] -> rotated copy [tokens, heads, D] (contiguous); cos / signed_sin
    [tokens, 1, D] in x's dtype (``reference.fused.rotary_cos_sin``)."""
    tokens, heads, head_dim = x.shape
    out = torch.empty((tokens, heads, head_dim), dtype=x.dtype)
    signed_sin = signed_sin.contiguous()
    _library().rotary_rows(x.data_ptr(), x.stride(0), cos.data_ptr(), signed_sin.data_ptr(), out.data_ptr(),
                           tokens, heads, head_dim, DTYPE_CODES[x.dtype], torch.get_num_threads())
    return out


def supports_silu_and_mul(gate_up: torch.Tensor) -> bool:
    """gate_up [rows, 2 * inter] float32 / bfloat16 on CPU, last dim contiguous."""
    return _rows_ok(gate_up) and _library() is not None


def silu_and_mul_cpu(gate_up):
    """gate_up [rows, 2 * inter] -> silu(gate) * up [rows, inter] (a new contiguous tensor)."""
    rows, width = gate_up.shape
    out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
    _library().silu_mul_rows(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.stride(0), rows, width // 2,
                             DTYPE_CODES[gate_up.dtype], torch.get_num_threads())
    return out


def supports_store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> bool:
    """key / value [tokens, kv_heads, D] with each token's row contiguous, caches contiguous on CPU in key's
    dtype (not 8-bit: those rows are quantized), int32 / int64 slots."""
    def rows_contiguous(t):
        return t.stride(2) == 1 and t.stride(1) == t.shape[2]
    return (key.device.type == "cpu" and key.dtype == value.dtype == k_cache.dtype == v_cache.dtype
            and key.element_size() in (2, 4) and rows_contiguous(key) and rows_contiguous(value)
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and slot_mapping.dtype in (torch.int32, torch.int64) and _library() is not None)


def store_kv_cpu(key, value, k_cache, v_cache, slot_mapping) -> None:
    """key / value [tokens, kv_heads, D] -> the caches [NB, bs, kv_heads, D] at slot_mapping [tokens]
    (slot = block * bs + offset; < 0 skipped). As ``store_kv_reference``, one C call."""
    tokens, heads, head_dim = key.shape
    slot_mapping = slot_mapping.to(torch.int32).contiguous()     # held by this frame during the call
    _library().store_kv_rows(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(),
                             v_cache.data_ptr(), slot_mapping.data_ptr(), tokens, heads * head_dim,
                             k_cache.shape[0] * k_cache.shape[1], key.element_size())
