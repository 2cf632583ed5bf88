"""The CPU prefill-attention kernel (``cpu_prefill.c``): built with the machine's C compiler on first use.

A prompt chunk of n tokens has n query rows per head over the same keys. Run as n decode rows
(``cpu_decode.c``), each row converts the chunk's K/V again; through SDPA (``reference._prefill_one``), each
sequence is gathered into a dense float32 copy and called on its own. This kernel takes a tile of query
tokens per work item, converts each key chunk once per tile, and shares every loaded K / V line between 4
rows (``cpu_prefill.c`` has the loop structure). ``kernels/api`` runs it for every prefill chunk longer than
one token up to the length timed on this CPU (``cpu_twins.prefill_c_max``), on the layouts
``supports`` accepts; the others keep the decode rows.

Decisions: docs/design/kernels.md, ``pagedray.kernels.cpu.cpu_prefill``.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib

import torch

from . import cpu_build
from .cpu_decode import MAX_BLOCK_SIZE, MAX_GROUP

SOURCE = pathlib.Path(__file__).with_name("cpu_prefill.c")
DTYPE_CODES = cpu_build.DTYPE_CODES
MAX_HEAD_DIM = 256
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURE = [_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _PTR, _I64,
              _PTR, _PTR, ctypes.c_float, _I64, ctypes.c_int, _PTR, _I64, _I64, ctypes.c_int, ctypes.c_int]


def _declare(library: ctypes.CDLL) -> None:
    signatures = {"paged_prefill_cpu": _SIGNATURE}
    if hasattr(library, "paged_prefill_amx"):     # absent from an older commit's library (benchmarks.c_kernels_ref)
        signatures["paged_prefill_amx"] = []
    cpu_build.declare(library, signatures, restype=ctypes.c_int)


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return cpu_build.load(SOURCE, _declare, "CPU prefill kernel", "prefill chunks run as decode rows or SDPA")


def supports(q: torch.Tensor, k_cache: torch.Tensor, alibi_slopes=None, logit_softcap=None) -> bool:
    """True when ``paged_prefill_cpu`` takes these (validated) tensors and the kernel is built: CPU,
    float32 / bfloat16 with the cache in q's dtype, head_dim a multiple of 16 up to 256, block_size a
    multiple of 8 up to 64, at most 64 query heads per KV head, no ALiBi and no soft-capping."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    return (q.device.type == "cpu" and q.dtype in DTYPE_CODES and k_cache.dtype == q.dtype
            and q.shape[2] % 16 == 0 and q.shape[2] <= MAX_HEAD_DIM and block_size % 8 == 0
            and block_size <= MAX_BLOCK_SIZE and q.shape[1] // num_kv_heads <= MAX_GROUP
            and alibi_slopes is None and logit_softcap is None and _library() is not None)


def amx_items() -> bool:
    """True when bfloat16 items with head_dim a multiple of 32 run through the AMX tiles here (the build
    targets AMX and Linux grants the tile state)."""
    library = _library()
    return library is not None and hasattr(library, "paged_prefill_amx") and bool(library.paged_prefill_amx())


def paged_prefill_cpu(q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, scale, sliding_window=None,
                      amx: bool = True):
    """q [T, Hq, D] holding each sequence's newest chunk (offsets cu_seqlens_q [S + 1] int32), caches
    [NB, bs, Hkv, D] in q's dtype, seq_lens_k [S] int32 (history + chunk), block_tables [S, max_blocks]
    int32 -> [T, Hq, D] in q's dtype (arguments already validated; ``supports`` checked). ``amx``: bfloat16
    items through the AMX tiles where ``amx_items()`` (False: the AVX-512 items, for tests and benchmarks)."""
    total, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    if q.stride(2) != 1:
        q = q.contiguous()
    if v_cache.stride() != k_cache.stride():                 # the kernel walks both with one set of strides
        k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    cu = cu_seqlens_q.to(torch.int32).contiguous()
    lens = seq_lens_k.to(torch.int32).contiguous()
    result = torch.empty((total, num_q_heads, head_dim), dtype=q.dtype)
    strides = k_cache.stride()
    status = _library().paged_prefill_cpu(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), strides[0], strides[1],
        strides[2], num_blocks, block_size, num_kv_heads, head_dim, lens.shape[0], num_q_heads // num_kv_heads,
        tables.data_ptr(), tables.stride(0), cu.data_ptr(), lens.data_ptr(), float(scale), int(sliding_window or 0),
        DTYPE_CODES[q.dtype], result.data_ptr(), result.stride(0), result.stride(1), torch.get_num_threads(),
        int(amx))
    if status != 0:
        raise MemoryError("paged_prefill_cpu: out of memory for the work list")
    return result
