"""The CPU decode-attention kernel (``cpu_decode.c``): built with the machine's C compiler on first use.

Decode attention on CPU used to gather each sequence's K/V blocks into a dense tensor per layer and
call SDPA (``reference._decode_rows``); at decode sizes that is mostly per-call overhead and copies.
The C kernel reads K/V rows straight from the paged cache, one sequence (or one of its KV heads) per
work item, with an online softmax in float32 (``cpu_decode.c`` has the loop structure).

Decisions: docs/design/kernels.md, ``pagedray.kernels.cpu.cpu_decode``.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib

import torch

from ..kv_quant import is_quantized
from . import cpu_build

SOURCE = pathlib.Path(__file__).with_name("cpu_decode.c")
DTYPE_CODES = cpu_build.DTYPE_CODES
CACHE_CODES = {**DTYPE_CODES, torch.int8: 2, torch.float8_e4m3fn: 3}    # 8-bit caches: cpu_decode.c
_INT64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_ARGTYPES = [_PTR, _INT64, _INT64, _PTR, _PTR, _INT64, _INT64, _INT64, _INT64, _INT64, _INT64, _INT64,
             _INT64, _INT64, _PTR, _INT64, _PTR, ctypes.c_float, _PTR, _INT64, ctypes.c_int, _PTR, _INT64,
             _INT64, ctypes.c_int, _PTR, _INT64, _INT64, _PTR, _INT64, _INT64, _PTR, ctypes.c_float, ctypes.c_int,
             _PTR, _PTR, ctypes.c_uint16, ctypes.c_uint16, _PTR]


def _declare(library: ctypes.CDLL) -> None:
    library.paged_decode_cpu.argtypes = _ARGTYPES
    library.paged_decode_cpu.restype = None
    library.stores_8bit_rows.argtypes = []
    library.stores_8bit_rows.restype = ctypes.c_int


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return cpu_build.load(SOURCE, _declare, "CPU decode kernel", "decode attention runs the torch reference")


def stores_rows_into(k_cache: torch.Tensor) -> bool:
    """True when the kernel's ``new_kv`` can write into this cache: one in q's dtype, or 8-bit rows (int8 or
    float8, quantized in C exactly as ``kv_quant.quantize_rows``; the build needs F16C for the float16 scale)."""
    if is_quantized(k_cache.dtype):
        return _stores_8bit_rows()
    return k_cache.dtype in DTYPE_CODES


@functools.lru_cache(maxsize=1)
def _stores_8bit_rows() -> bool:
    """Asked once (a ctypes call per layer and step would be on the decode hot path)."""
    return available() and bool(_library().stores_8bit_rows())


@functools.lru_cache(maxsize=None)
def static_scale_bits(static_scales) -> tuple[int, int]:
    """A checkpoint's (k, v) KV scales (``kv_quant.static_scale`` values) as the kernel takes them: float16
    bits, (0, 0) for none (each row's own scale). Cached: a layer's pair is asked for on every decode call."""
    if static_scales is None:
        return 0, 0
    bits = torch.tensor(static_scales, dtype=torch.float16).view(torch.int16).tolist()
    return bits[0] & 0xFFFF, bits[1] & 0xFFFF


def available() -> bool:
    """True when the compiled kernel can run (it is built on the first call)."""
    return _library() is not None


MAX_BLOCK_SIZE = 64
MAX_GROUP = 64
MAX_HEAD_DIM = 256       # the kernel's row buffers (cpu_decode.c)


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """True when ``paged_decode_cpu`` takes these (validated) tensors and the kernel is built: CPU,
    float32/bfloat16 (the cache in q's dtype or 8-bit), head_dim a multiple of 16 (the kernel's vector width)
    up to 256 (other head sizes run the torch reference), block_size a multiple of 8 up to 64, at most 64 query heads
    per KV head."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    cache_ok = k_cache.dtype == q.dtype or is_quantized(k_cache.dtype)
    return (q.device.type == "cpu" and q.dtype in DTYPE_CODES and cache_ok and q.shape[2] % 16 == 0
            and q.shape[2] <= MAX_HEAD_DIM
            and block_size % 8 == 0
            and block_size <= MAX_BLOCK_SIZE and q.shape[1] // num_kv_heads <= MAX_GROUP and available())


def paged_decode_cpu(q, k_cache, v_cache, block_tables, seq_lens, scale, alibi_slopes=None,
                     sliding_window=None, out=None, new_kv=None, logit_softcap=None, k_scale=None, v_scale=None,
                     static_scales=None, sinks=None):
    """``paged_decode_reference``'s contract through the C kernel (arguments already validated).

    q [S, Hq, D] (head_dim contiguous); k/v_cache [NB, bs, Hkv, D]; block_tables [S, max_blocks] int32;
    seq_lens [S] int32 -> out [S, Hq, D] in q.dtype. ``new_kv``: (key, value [S, Hkv, D] head_dim contiguous,
    slot_mapping [S] int32 or int64): each sequence's new token, stored into the caches first (``store_kv``'s
    contract for a decode step, slot < 0 skipped), by the same call. ``logit_softcap``: Gemma 2's soft-capping
    of the scaled scores. ``k_scale`` / ``v_scale`` [NB, bs, Hkv] float16, contiguous: an 8-bit cache's row
    scales (``kv_quant``), into which ``new_kv``'s rows are quantized; ``static_scales``: a float8 cache's
    checkpoint scales (``kv_quant``) for them. ``sinks`` [Hq] float32: gpt-oss's per-head sink logits.
    """
    quantized = is_quantized(k_cache.dtype)
    if new_kv is not None and k_cache.dtype != q.dtype and not (quantized and k_scale is not None
                                                                 and stores_rows_into(k_cache)):
        raise ValueError("new_kv: the decode kernel writes a cache in q's dtype or 8-bit rows (with their scales)")
    num_seqs, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    group = num_q_heads // num_kv_heads
    if q.stride(2) != 1:
        q = q.contiguous()
    tables = block_tables.contiguous()
    lens = seq_lens.contiguous()
    slopes = None if alibi_slopes is None else alibi_slopes.to(torch.float32).contiguous()
    result = torch.empty((num_seqs, num_q_heads, head_dim), dtype=q.dtype)
    if v_cache.stride() != k_cache.stride():                 # the kernel walks both with one set of strides
        if new_kv is not None:
            raise ValueError("new_kv: the caches must share strides (the kernel writes them in place)")
        k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    k_strides = k_cache.stride()
    _library().paged_decode_cpu(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        k_strides[0], k_strides[1], k_strides[2], num_blocks, block_size, num_kv_heads, head_dim,
        num_seqs, group, tables.data_ptr(), tables.stride(0), lens.data_ptr(), float(scale),
        None if slopes is None else slopes.data_ptr(), int(sliding_window or 0), DTYPE_CODES[q.dtype],
        result.data_ptr(), result.stride(0), result.stride(1), torch.get_num_threads(), *_new_kv_args(new_kv, k_cache),
        float(logit_softcap or 0.0), CACHE_CODES[k_cache.dtype],
        None if k_scale is None else k_scale.data_ptr(), None if v_scale is None else v_scale.data_ptr(),
        *static_scale_bits(static_scales), None if sinks is None else sinks.data_ptr())
    if out is None:
        return result
    out.copy_(result)
    return out


def _new_kv_args(new_kv, k_cache) -> tuple:
    """The kernel's (k_new, its token / head strides, v_new, its strides, slots) arguments: NULLs without
    ``new_kv``."""
    if new_kv is None:
        return None, 0, 0, None, 0, 0, None
    key, value, slots = new_kv
    quantized = is_quantized(k_cache.dtype)
    want = key.dtype if quantized else k_cache.dtype                       # 8-bit: rows quantized from q's dtype
    if key.stride(2) != 1 or value.stride(2) != 1 or key.dtype != want or value.dtype != want:
        raise ValueError("new_kv: key and value must have the cache's dtype and a contiguous head_dim")
    if slots.dtype != torch.int32 or not slots.is_contiguous():
        raise ValueError("new_kv: slot_mapping must be contiguous int32 (the model runner's are)")
    return (key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(), value.stride(0), value.stride(1),
            slots.data_ptr())
