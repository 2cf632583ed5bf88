"""Triton paged decode (one query token per sequence) with GQA grouping and split-KV.

Decisions: docs/design/kernels.md, ``pagedray.kernels.triton.decode_triton``.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from .occupancy import resident_programs, wave_num_splits
from .tile_keys_major_triton import attend_keys_major
from .tile_triton import INT8_BIAS, attend_tile, queries_in_f16, scale_args

LOG2E = 1.4426950408889634
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
INTERPRETER_SM_COUNT = 8   # nominal "device size" used to choose splits under TRITON_INTERPRET


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, alibi_ptr,
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, k_scale_ptr, v_scale_ptr, stride_sb, stride_ss,
    scale_log2, softcap, stride_qs, stride_qh, stride_os, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    head_dim, group_size, sliding_window, num_splits, sinks_ptr,
    BLOCK_SIZE: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr,
    IEEE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, QUANT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    K_CVT: tl.constexpr = 0, V_CVT: tl.constexpr = 0, F16_MATH: tl.constexpr = False,
    KEYS_MAJOR: tl.constexpr = False, HAS_SINKS: tl.constexpr = False,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)

    g = tl.arange(0, BLOCK_G)
    g_mask = g < group_size
    heads = kv_head * group_size + g                                      # [BLOCK_G] query heads
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)      # [BLOCK_G, BLOCK_D]
    row_scale = scale_log2
    if F16_MATH:                      # 8-bit codes, bf16 queries: both products in float16 (queries_in_f16)
        q, row_scale = queries_in_f16(q, scale_log2)
    slope = tl.zeros([BLOCK_G], tl.float32)
    if HAS_ALIBI:
        slope = tl.load(alibi_ptr + heads, mask=g_mask, other=0.0) * 1.4426950408889634

    win_start = 0
    if HAS_WINDOW:
        win_start = tl.maximum(seq_len - sliding_window, 0)
    num_tiles = tl.cdiv(seq_len - win_start, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    start = win_start + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    q_pos = tl.zeros([BLOCK_G], tl.int32) + (seq_len - 1)                    # every row: the last token
    table = block_tables_ptr + seq * stride_bt
    # keys in [start, end) are all inside the window and <= q_pos: only `n < end` matters, in the last tile only
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    m, l, acc = _attend_range(q, row_scale, start, full_end, end, k_cache_ptr + kv_head * stride_kh,
                              v_cache_ptr + kv_head * stride_vh, table, q_pos, slope,
                              stride_kb, stride_ks, stride_vb, stride_vs, softcap, d, d_mask,
                              k_scale_ptr + kv_head, v_scale_ptr + kv_head, stride_sb, stride_ss,
                              BLOCK_SIZE, HAS_ALIBI, IEEE, HAS_SOFTCAP, QUANT, BLOCK_N, K_CVT, V_CVT, F16_MATH,
                              KEYS_MAJOR)

    if SPLIT:
        part = (seq * (group_size * tl.num_programs(1)) + heads) * num_splits + split   # [BLOCK_G]
        tl.store(part_m_ptr + part, m, mask=g_mask)
        tl.store(part_l_ptr + part, l, mask=g_mask)
        tl.store(part_acc_ptr + part[:, None] * head_dim + d[None, :], acc,
                 mask=g_mask[:, None] & d_mask[None, :])
    else:
        if HAS_SINKS:   # one more logit per head (base 2, as m), with no value row: only the denominator grows
            l += tl.math.exp2(tl.load(sinks_ptr + heads, mask=g_mask, other=0.0) * 1.4426950408889634 - m)
        o = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _attend_range(q, scale_log2, start, full_end, end, k_base, v_base, table, q_pos, slope,
                  stride_kb, stride_ks, stride_vb, stride_vs, softcap, d, d_mask, ks_base, vs_base, stride_sb,
                  stride_ss, BLOCK_SIZE: tl.constexpr, HAS_ALIBI: tl.constexpr, IEEE: tl.constexpr,
                  HAS_SOFTCAP: tl.constexpr, QUANT: tl.constexpr, BLOCK_N: tl.constexpr, K_CVT: tl.constexpr,
                  V_CVT: tl.constexpr, F16_MATH: tl.constexpr, KEYS_MAJOR: tl.constexpr):
    """Keys [start, end) of one sequence for the query rows ``q`` [BLOCK_G, BLOCK_D] (``scale_log2`` a scalar, or
    [BLOCK_G, 1] with ``F16_MATH``) -> (m, l, acc [BLOCK_G, BLOCK_D]): whole tiles up to ``full_end`` without
    per-key predicates, then the partial one. ``KEYS_MAJOR``: scores as K @ q^T (``tile_keys_major_triton``),
    the output accumulated transposed and turned back once at the end, the softmax's sums kept per key slot
    and added once, and int8 codes into float16 products biased (the module docstring there)."""
    m = tl.full([q.shape[0]], float("-inf"), tl.float32)
    l = tl.zeros([q.shape[0]], tl.float32)
    if KEYS_MAJOR:
        qt = tl.trans(q)                                                   # [BLOCK_D, BLOCK_G]
        col_scale = scale_log2
        if F16_MATH:
            col_scale = tl.reshape(scale_log2, [1, q.shape[0]])
        biased: tl.constexpr = QUANT and q.dtype == tl.float16 and k_base.dtype.element_ty == tl.int8
        k_bias = tl.zeros([1, q.shape[0]], tl.float32)       # int8 codes into float16 products go in biased
        if biased:
            k_bias = INT8_BIAS * tl.reshape(tl.sum(q.to(tl.float32), 1), [1, q.shape[0]])
        acc_t = tl.zeros([q.shape[1], q.shape[0]], tl.float32)
        l_slots = tl.zeros([BLOCK_N, q.shape[0]], tl.float32)
        for n0 in range(start, full_end, BLOCK_N):
            m, l_slots, acc_t = attend_keys_major(qt, m, l_slots, acc_t, n0, k_base, v_base, table, q_pos, slope,
                                                  end, stride_kb, stride_ks, stride_vb, stride_vs, col_scale,
                                                  softcap, d, d_mask, ks_base, vs_base, stride_sb, stride_ss,
                                                  BLOCK_SIZE, False, HAS_ALIBI, IEEE, HAS_SOFTCAP, QUANT, BLOCK_N,
                                                  K_CVT, V_CVT, FULL=True, k_bias=k_bias, BIASED=biased)
        if full_end < end:
            m, l_slots, acc_t = attend_keys_major(qt, m, l_slots, acc_t, full_end, k_base, v_base, table, q_pos,
                                                  slope, end, stride_kb, stride_ks, stride_vb, stride_vs, col_scale,
                                                  softcap, d, d_mask, ks_base, vs_base, stride_sb, stride_ss,
                                                  BLOCK_SIZE, True, HAS_ALIBI, IEEE, HAS_SOFTCAP, QUANT, BLOCK_N,
                                                  K_CVT, V_CVT, k_bias=k_bias, BIASED=biased)
        l = tl.sum(l_slots, 0)
        acc = tl.trans(acc_t)
    else:
        acc = tl.zeros([q.shape[0], q.shape[1]], tl.float32)
        for n0 in range(start, full_end, BLOCK_N):
            m, l, acc = attend_tile(q, m, l, acc, n0, k_base, v_base, table, q_pos, slope, end,
                                    stride_kb, stride_ks, stride_vb, stride_vs, 0, scale_log2, softcap, d, d_mask,
                                    ks_base, vs_base, stride_sb, stride_ss, BLOCK_SIZE, False, HAS_ALIBI, False,
                                    IEEE, HAS_SOFTCAP, QUANT, BLOCK_N, K_CVT, V_CVT, FULL=True)
        if full_end < end:
            m, l, acc = attend_tile(q, m, l, acc, full_end, k_base, v_base, table, q_pos, slope, end,
                                    stride_kb, stride_ks, stride_vb, stride_vs, 0, scale_log2, softcap, d, d_mask,
                                    ks_base, vs_base, stride_sb, stride_ss, BLOCK_SIZE, True, HAS_ALIBI, False,
                                    IEEE, HAS_SOFTCAP, QUANT, BLOCK_N, K_CVT, V_CVT)
    return m, l, acc


@triton.jit
def _reduce_splits_kernel(
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, stride_os, stride_oh, head_dim, num_splits, sinks_ptr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr = False,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head
    sp = tl.arange(0, BLOCK_S)
    sp_mask = sp < num_splits
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    ms = tl.load(part_m_ptr + row * num_splits + sp, mask=sp_mask, other=float("-inf"))   # [BLOCK_S]
    ls = tl.load(part_l_ptr + row * num_splits + sp, mask=sp_mask, other=0.0)
    m_max = tl.max(ms, 0)
    m_ref = tl.where(m_max > float("-inf"), m_max, 0.0)
    w = tl.where(ms > float("-inf"), tl.math.exp2(ms - m_ref), 0.0)     # empty splits weigh 0
    l_tot = tl.sum(ls * w, 0)
    if HAS_SINKS:       # the sink joins the combined softmax once, relative to the same reference max
        l_tot += tl.math.exp2(tl.load(sinks_ptr + head) * 1.4426950408889634 - m_ref)
    acc = tl.load(part_acc_ptr + (row * num_splits + sp)[:, None] * head_dim + d[None, :],
                  mask=sp_mask[:, None] & d_mask[None, :], other=0.0)   # [BLOCK_S, BLOCK_D]
    o = tl.sum(acc * w[:, None], 0) / tl.where(l_tot > 0, l_tot, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d, o.to(out_ptr.dtype.element_ty),
             mask=d_mask)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a nominal count for the CPU interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_SM_COUNT


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int,
                      programs_per_sm: int | None = None) -> int:
    """Split count, with >= MIN_TOKENS_PER_SPLIT keys per split: without ``programs_per_sm``, so that ~2
    programs per SM cover the device (the rule the bf16 decode was measured with); with it (the 8-bit decode
    on CUDA, whose 128-key programs fit 3 to an SM), the count that fills whole waves
    (``occupancy.wave_num_splits``)."""
    programs = max(1, num_seqs * num_kv_heads)
    by_context = max(1, max_context // MIN_TOKENS_PER_SPLIT)
    if programs_per_sm:
        return wave_num_splits(programs, num_sms * programs_per_sm, min(by_context, MAX_SPLITS))
    wanted = triton.cdiv(2 * num_sms, programs)
    return max(1, min(wanted, by_context, MAX_SPLITS))


def decode_config(head_dim: int, group: int, quantized: bool = False, fast_codes: bool = False) -> dict:
    """Launch constants of the decode kernel: ``BLOCK_G`` query-head rows (padded to 16 for ``tl.dot``),
    ``BLOCK_N`` keys per tile, ``BLOCK_D`` >= head_dim, warps and software-pipelining stages, and ``maxnreg``
    (registers per thread) at head_dim <= 128 and up to 16 query rows: the loop over full tiles (no per-key
    predicates) plus the last tile as a second copy took the sm_90 compile to 120-170 registers, which would
    cost a program per SM; 128 keeps 4 bf16 programs per SM (168: 3 for the 128-key 8-bit tiles, which shared
    memory holds to 3), without spills under Triton 3.9 (3.6: 8 bytes of stack; sm_90 bf16 at head_dim 128: 38
    KB shared, 401 loop instructions per 64 keys against 569 with predicates; see
    ``benchmarks/sm90_report.py``). 32 query rows (MQA-like groups) spilled 336 bytes at 128 and are not capped
    (211 registers, 2 programs per SM). fp32 queries spill at any cap (Triton's fp32 products: docs/gpu.md).

    An 8-bit cache (``quantized``) takes 32-key tiles in 3 stages: on an H100 at batch 64, 8k context that ran
    1.37x the 64-key, 2-stage tiles with Triton's cast (``benchmarks.kernel_sweep --cache-dtype int8``). With
    ``fast_codes`` (CUDA, bf16 queries) its codes are converted by ``tile_triton.codes_to``'s asm (K in
    registers, V before its shared copy), and up to 8 query rows per KV head at head_dim <= 128 take the
    keys-major form (``tile_keys_major_triton``: scores as K @ q^T, the rows padded to 8 columns) in 64-key
    tiles, 2 warps, 2 stages, uncapped: on an H100 at batch 64, 8k (head_dim 128, 4 rows) int8 1.66x and fp8
    1.68x the bf16 cache's decode, against 1.56x for both in the 16-row form's 128-key, 4-warp tiles, which
    larger groups and head_dim 256 (64-key tiles there) keep (docs/gpu.md, H100 2026-11-27)."""
    cfg = dict(BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=32 if quantized else 64,
               BLOCK_D=max(16, triton.next_power_of_2(head_dim)), num_warps=4, num_stages=3 if quantized else 2)
    keys_major = quantized and fast_codes and group <= 8 and cfg["BLOCK_D"] <= 128
    if keys_major:                   # 6 programs per SM uncapped (sm_90)
        cfg.update(KEYS_MAJOR=True, BLOCK_G=8, BLOCK_N=64, num_warps=2, num_stages=2, K_CVT=1, V_CVT=2)
    elif quantized and fast_codes:   # 16 KiB of codes a tile: head_dim 256 would hold 1 program per SM at 128
        cfg.update(BLOCK_N=min(128, 16384 // cfg["BLOCK_D"]), num_stages=2, K_CVT=1, V_CVT=2)
    elif cfg["BLOCK_D"] > 256:       # Gemma 4's 512: 32-key tiles, one stage (64-key double-buffered K and V tiles
        cfg.update(BLOCK_N=32, num_stages=1)   # would take 256 KiB of shared memory); never run on a GPU yet
    capped = cfg["BLOCK_D"] <= 128 and cfg["BLOCK_G"] <= 16 and not keys_major   # 32 query rows at 128 spilled 336 B
    cfg["maxnreg"] = (168 if quantized and fast_codes else 128) if capped else None
    return cfg


def paged_decode_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, alibi_slopes=None,
                        sliding_window=None, out=None, *, num_splits=None, config=None, logit_softcap=None,
                        k_scale=None, v_scale=None, sinks=None):
    """Launch the decode kernel (and the split reduce). Shapes as in ``pagedray.kernels.paged_decode``;
    ``num_splits`` overrides the automatic choice (tests use it to force the split path) and ``config``
    overrides entries of ``decode_config`` (the benchmark's ``--sweep`` uses it); ``KEYS_MAJOR`` in it computes
    the scores as K @ q^T (``tile_keys_major_triton``), with ``BLOCK_G`` (8 is its narrowest) >= the query
    heads per KV head and a power of two, else ValueError. ``k_scale`` / ``v_scale``: an 8-bit cache's row scales
    (``kv_quant``). ``sinks`` [num_q_heads] float32: gpt-oss's sink logits, added in the last split reduction (or
    the kernel itself without splits)."""
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    fast_codes = q.is_cuda and q.dtype == torch.bfloat16     # measured on GPUs with bf16 queries only (docs/gpu.md)
    cfg = {**decode_config(head_dim, group, k_scale is not None, fast_codes), **(config or {})}
    rows = cfg["BLOCK_G"]
    if rows < group or rows & (rows - 1):
        raise ValueError(f"config: BLOCK_G {rows} must be a power of two holding the {group} query heads per KV head")

    def launch(splits: int, part_m, part_l, part_acc, grid, warm_up: bool = False):
        args = (q, k_cache, v_cache, block_tables, seq_lens,
                alibi_slopes if alibi_slopes is not None else q, out, part_m, part_l, part_acc,
                *scale_args(k_scale, v_scale, q),
                float(scale) * LOG2E, float(logit_softcap or 1.0), q.stride(0), q.stride(1), out.stride(0),
                out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
                head_dim, group, sliding_window or 0, splits, sinks if sinks is not None else q)
        consts = dict(BLOCK_SIZE=block_size, HAS_ALIBI=alibi_slopes is not None, HAS_SINKS=sinks is not None,
                      HAS_WINDOW=sliding_window is not None, SPLIT=splits > 1, IEEE=q.dtype == torch.float32,
                      HAS_SOFTCAP=logit_softcap is not None, QUANT=k_scale is not None, **cfg)
        if warm_up:                           # compile only (the launch below reuses it): what an SM holds
            return _decode_kernel.warmup(*args, grid=grid, **consts)
        return _decode_kernel[grid](*args, **consts)

    if num_splits is None:
        capacity = block_tables.shape[1] * block_size
        per_sm = None
        if _fills_waves(q, k_scale):            # the 8-bit decode: splits that fill whole waves

            def compile_split_kernel():
                probe = torch.empty(1, dtype=torch.float32, device=q.device)    # only its type matters
                return launch(2, probe, probe, probe, (1,), warm_up=True)

            per_sm = _programs_per_sm(compile_split_kernel, cfg, q, k_cache, head_dim, group, block_size)
        num_splits = choose_num_splits(num_seqs, num_kv_heads, capacity, sm_count(q.device), per_sm)
    split = num_splits > 1
    part_shape = (num_seqs, num_q_heads, num_splits) if split else (1,)
    part_m = torch.empty(part_shape, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(part_shape + ((head_dim,) if split else ()), dtype=torch.float32,
                           device=q.device)
    launch(num_splits, part_m, part_l, part_acc, (num_seqs, num_kv_heads, num_splits))
    if split:
        _reduce_splits_kernel[(num_seqs, num_q_heads)](
            out, part_m, part_l, part_acc, out.stride(0), out.stride(1), head_dim, num_splits,
            sinks if sinks is not None else q, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
            BLOCK_D=cfg["BLOCK_D"], HAS_SINKS=sinks is not None, num_warps=4,
        )
    return out


def _fills_waves(q, k_scale) -> bool:
    """The launches whose split count follows the programs an SM holds: the 8-bit decode on CUDA."""
    return q.is_cuda and k_scale is not None


_PROGRAMS_PER_SM: dict[tuple, int | None] = {}   # (device, dtypes, shape constants, config) -> programs per SM


def _programs_per_sm(compile_split_kernel, cfg: dict, q, k_cache, head_dim: int, group: int,
                     block_size: int) -> int | None:
    """Programs per SM of the split decode kernel for this launch's configuration, compiled once (a cache
    keyed by what changes the code); None, with a warning, when Triton cannot tell (the ~2-per-SM rule then
    applies)."""
    key = (q.device, q.dtype, k_cache.dtype, head_dim, group, block_size, tuple(sorted(cfg.items())))
    if key not in _PROGRAMS_PER_SM:
        try:
            _PROGRAMS_PER_SM[key] = resident_programs(compile_split_kernel(), cfg.get("num_warps", 4), q.device)
        except Exception as exc:  # noqa: BLE001 - a split heuristic: never fail the decode for it
            warnings.warn(f"decode: programs per SM unknown ({type(exc).__name__}: {exc}); splits by the "
                          f"2-per-SM rule", RuntimeWarning, stacklevel=3)
            _PROGRAMS_PER_SM[key] = None
    return _PROGRAMS_PER_SM[key]
