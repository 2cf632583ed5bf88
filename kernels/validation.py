"""Argument checks shared by the public kernel wrappers.

Every check raises ``ValueError`` whose message starts with the offending argument's name, and runs
before any kernel is launched or any cache slot is written.

Two kinds of checks:

* **Structural** (ranks, shapes, dtypes, devices, strides, head_dim, GQA divisibility): they read only
  tensor metadata, cost nothing and always run.
* **Value** checks read tensor *contents*: ``seq_lens`` within ``[0, block_tables.shape[1] * block_size]``,
  ``cu_seqlens_q`` starting at 0, non-decreasing and ending at ``q.shape[0]``, each query chunk no longer
  than its ``seq_lens_k``, referenced block ids inside the cache, slots inside the cache. On CUDA tensors
  these need a device-to-host sync, so they are controlled by ``validate_values``: ``None`` (the default)
  means "on for CPU tensors, off for CUDA tensors", so the GPU hot path never syncs; pass ``True`` to
  force them (tests, debugging).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .kv_quant import QUANTIZED, SCALE_DTYPE

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CACHE_DTYPES = SUPPORTED_DTYPES + QUANTIZED          # 8-bit caches carry float16 scales (kv_quant)
MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 512       # Gemma 4's full-attention layers; the C kernels take up to 256 (their supports())
HEAD_DIM_MULTIPLE = 8


def _fail(name: str, message: str) -> None:
    raise ValueError(f"{name}: {message}")


def values_checked(validate_values: bool | None, device: torch.device) -> bool:
    """Resolve the ``validate_values`` flag: default on for CPU, off for CUDA (avoids a sync)."""
    if validate_values is None:
        return device.type != "cuda"
    return bool(validate_values)


def check_tensor(name: str, t, rank: int, device: torch.device | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(name, f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        _fail(name, f"expected rank {rank}, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        _fail(name, f"expected device {device}, got {t.device}")


def check_int32(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.int32:
        _fail(name, f"expected dtype torch.int32, got {t.dtype}")


def check_caches(k_cache, v_cache) -> None:
    """k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim], same shape/dtype/device."""
    check_tensor("k_cache", k_cache, 4)
    check_tensor("v_cache", v_cache, 4, k_cache.device)
    if v_cache.shape != k_cache.shape:
        _fail("v_cache", f"shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}")
    if k_cache.dtype not in CACHE_DTYPES:
        _fail("k_cache", f"unsupported dtype {k_cache.dtype}; expected one of {CACHE_DTYPES}")
    if v_cache.dtype != k_cache.dtype:
        _fail("v_cache", f"dtype {v_cache.dtype} differs from k_cache {k_cache.dtype}")
    head_dim = k_cache.shape[3]
    if not (MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM and head_dim % HEAD_DIM_MULTIPLE == 0):
        _fail("k_cache", f"unsupported head_dim {head_dim}; expected a multiple of {HEAD_DIM_MULTIPLE} "
                         f"in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(3) != 1:
            _fail(name, "head_dim must be contiguous (stride(3) == 1)")
    if min(k_cache.shape[:3]) <= 0:
        _fail("k_cache", f"empty dimension in shape {tuple(k_cache.shape)}")


def check_kv_scales(k_cache, k_scale, v_scale) -> None:
    """k_scale/v_scale: float16 [num_blocks, block_size, num_kv_heads] with an 8-bit cache, None otherwise."""
    quantized = k_cache.dtype in QUANTIZED
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not quantized:
            if t is not None:
                _fail(name, f"only an int8 / fp8 cache has scales; k_cache is {k_cache.dtype}")
            continue
        if t is None:
            _fail(name, f"required with a {k_cache.dtype} cache (one float16 scale per cached row)")
        check_tensor(name, t, 3, k_cache.device)
        if tuple(t.shape) != tuple(k_cache.shape[:3]) or t.dtype != SCALE_DTYPE or not t.is_contiguous():
            _fail(name, f"expected a contiguous {SCALE_DTYPE} tensor of shape {tuple(k_cache.shape[:3])}, got "
                        f"{t.dtype} {tuple(t.shape)}")


def check_static_scales(static_scales, k_cache) -> None:
    """static_scales: None, or (k, v) positive finite floats for a float8 cache (a checkpoint's KV scales)."""
    if static_scales is None:
        return
    if k_cache.dtype != torch.float8_e4m3fn:
        _fail("static_scales", f"only a float8_e4m3fn cache takes a checkpoint's scales; k_cache is {k_cache.dtype}")
    if (not isinstance(static_scales, tuple) or len(static_scales) != 2
            or not all(isinstance(s, float) and math.isfinite(s) and s > 0 for s in static_scales)):
        _fail("static_scales", f"expected (k_scale, v_scale), two positive finite floats, got {static_scales!r}")


def check_heads_tensor(name: str, t, k_cache: torch.Tensor, num_kv_heads_match: bool) -> None:
    """q/key/value/out: [tokens, heads, head_dim] matching the cache's dtype (any compute dtype for an
    8-bit cache), device and head_dim."""
    check_tensor(name, t, 3, k_cache.device)
    if k_cache.dtype in QUANTIZED:
        if t.dtype not in SUPPORTED_DTYPES:
            _fail(name, f"unsupported dtype {t.dtype}; expected one of {SUPPORTED_DTYPES}")
    elif t.dtype != k_cache.dtype:
        _fail(name, f"dtype {t.dtype} differs from k_cache {k_cache.dtype}")
    if t.shape[2] != k_cache.shape[3]:
        _fail(name, f"head_dim {t.shape[2]} differs from k_cache head_dim {k_cache.shape[3]}")
    if t.shape[2] > 1 and t.stride(2) != 1:
        _fail(name, "head_dim must be contiguous (stride(2) == 1)")
    num_kv_heads = k_cache.shape[2]
    if num_kv_heads_match and t.shape[1] != num_kv_heads:
        _fail(name, f"{t.shape[1]} heads, expected num_kv_heads = {num_kv_heads}")
    if not num_kv_heads_match and (t.shape[1] == 0 or t.shape[1] % num_kv_heads != 0):
        _fail(name, f"{t.shape[1]} query heads are not a positive multiple of {num_kv_heads} KV heads")


def check_scale(scale) -> None:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
            or scale <= 0:
        _fail("scale", f"expected a positive finite float, got {scale!r}")


def _check_per_head(name: str, values, q: torch.Tensor) -> None:
    """None, or a float32 [num_q_heads] tensor on q's device."""
    if values is None:
        return
    check_tensor(name, values, 1, q.device)
    if values.dtype != torch.float32:
        _fail(name, f"expected dtype torch.float32, got {values.dtype}")
    if values.shape[0] != q.shape[1]:
        _fail(name, f"expected shape [{q.shape[1]}] (num_q_heads), got {tuple(values.shape)}")


def check_alibi(alibi_slopes, q: torch.Tensor) -> None:
    _check_per_head("alibi_slopes", alibi_slopes, q)


def check_sinks(sinks, q: torch.Tensor) -> None:
    """gpt-oss's attention sinks: None, or float32 [num_q_heads] contiguous on q's device (finite values: the
    kernels add exp(sink - max) to each softmax's denominator)."""
    _check_per_head("sinks", sinks, q)
    if sinks is not None and not sinks.is_contiguous():
        _fail("sinks", "expected a contiguous tensor")


def check_sliding_window(sliding_window) -> None:
    if sliding_window is None:
        return
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window <= 0:
        _fail("sliding_window", f"expected None or a positive int, got {sliding_window!r}")


def check_out(out, q: torch.Tensor) -> None:
    if out is None:
        return
    check_tensor("out", out, 3, q.device)
    if out.shape != q.shape or out.dtype != q.dtype:
        _fail("out", f"expected shape {tuple(q.shape)} and dtype {q.dtype}, "
                     f"got {tuple(out.shape)} {out.dtype}")
    if out.stride(2) != 1:
        _fail("out", "head_dim must be contiguous (stride(2) == 1)")


def check_block_tables(block_tables, seq_lens, num_seqs: int, device: torch.device,
                       lens_name: str = "seq_lens") -> None:
    """block_tables [num_seqs, max_blocks] int32; seq_lens [num_seqs] int32 (reported as ``lens_name``)."""
    check_tensor("block_tables", block_tables, 2, device)
    check_int32("block_tables", block_tables)
    if block_tables.shape[0] != num_seqs:
        _fail("block_tables", f"{block_tables.shape[0]} rows, expected num_seqs = {num_seqs}")
    if block_tables.stride(1) != 1:
        _fail("block_tables", "rows must be contiguous (stride(1) == 1)")
    check_tensor(lens_name, seq_lens, 1, device)
    check_int32(lens_name, seq_lens)
    if seq_lens.shape[0] != num_seqs:
        _fail(lens_name, f"shape {tuple(seq_lens.shape)}, expected [{num_seqs}]")


def host_values(t: torch.Tensor):
    """A tensor's values for a value check: a NumPy view of a CPU tensor (an op on it costs a microsecond where a
    torch op on a small tensor costs tens), else the tensor itself (the check then syncs with its device)."""
    return t.numpy() if t.device.type == "cpu" else t


def check_seq_len_values(name: str, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                         k_cache: torch.Tensor) -> None:
    """Value check (syncs on CUDA): 0 <= seq_len <= capacity and every used block id is in the cache."""
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    capacity = block_tables.shape[1] * block_size
    if seq_lens.numel() == 0:
        return
    lens, tables = host_values(seq_lens), host_values(block_tables)
    lo, hi = int(lens.min()), int(lens.max())
    if lo < 0:
        _fail(name, f"negative length {lo}")
    if hi > capacity:
        _fail(name, f"length {hi} exceeds the block table capacity {capacity} "
                    f"(block_tables.shape[1] * block_size = {block_tables.shape[1]} * {block_size})")
    num_used = (lens + block_size - 1) // block_size                            # [num_seqs]
    if isinstance(tables, torch.Tensor):
        cols = torch.arange(tables.shape[1], device=tables.device)
    else:
        cols = np.arange(tables.shape[1])
    used = cols[None, :] < num_used[:, None]                                   # [num_seqs, max_blocks]
    bad = used & ((tables < 0) | (tables >= num_blocks))
    if bool(bad.any()):
        _fail("block_tables", f"a block id used by {name} is outside [0, {num_blocks})")


def check_cu_seqlens(cu_seqlens_q, seq_lens_k, total_q: int, validate: bool) -> None:
    """cu_seqlens_q [num_seqs + 1] int32; with ``validate``: 0 = cu[0] <= ... <= cu[-1] = total_q and
    each chunk length <= its seq_lens_k."""
    check_tensor("cu_seqlens_q", cu_seqlens_q, 1, seq_lens_k.device)
    check_int32("cu_seqlens_q", cu_seqlens_q)
    if cu_seqlens_q.shape[0] != seq_lens_k.shape[0] + 1:
        _fail("cu_seqlens_q", f"shape {tuple(cu_seqlens_q.shape)}, expected [num_seqs + 1] = "
                              f"[{seq_lens_k.shape[0] + 1}]")
    if not validate:
        return
    cu = cu_seqlens_q.cpu().numpy()
    if cu[0] != 0 or cu[-1] != total_q:
        _fail("cu_seqlens_q", f"must start at 0 and end at q.shape[0] = {total_q}, got {cu[0]}..{cu[-1]}")
    q_lens = np.diff(cu)
    if (q_lens < 0).any():
        _fail("cu_seqlens_q", "must be non-decreasing")
    too_long = q_lens > seq_lens_k.cpu().numpy()
    if too_long.any():
        i = int(too_long.argmax())
        _fail("cu_seqlens_q", f"sequence {i} has {q_lens[i]} query tokens but seq_lens_k = {int(seq_lens_k[i])}")


def check_slot_mapping(slot_mapping, num_tokens: int, k_cache: torch.Tensor, validate: bool) -> None:
    """slot_mapping [num_tokens] int32/int64; with ``validate``: every slot < num_blocks * block_size."""
    check_tensor("slot_mapping", slot_mapping, 1, k_cache.device)
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        _fail("slot_mapping", f"expected dtype torch.int32 or torch.int64, got {slot_mapping.dtype}")
    if slot_mapping.shape[0] != num_tokens:
        _fail("slot_mapping", f"shape {tuple(slot_mapping.shape)}, expected [{num_tokens}]")
    if validate and num_tokens > 0:
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        hi = int(host_values(slot_mapping).max())
        if hi >= num_slots:
            _fail("slot_mapping", f"slot {hi} is outside the cache ({num_slots} slots)")
