"""Triton paged prefill: varlen causal query chunks over a history already in the paged cache.

Decisions: docs/design/kernels.md, ``pagedray.kernels.triton.prefill_triton``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .tile_triton import attend_tile, scale_args

LOG2E = 1.4426950408889634


@triton.jit
def _find_chunk(cu_q_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest i in [0, num_seqs) with cu_q[i] // BLOCK_Q + i <= tile (binary search)."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(start <= tile, mid, lo)
        hi = tl.where(start <= tile, hi, mid)
    return lo


@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_q_ptr, alibi_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr, stride_sb, stride_ss, scale_log2, softcap, stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    num_seqs, head_dim, group_size, sliding_window, sinks_ptr,
    BLOCK_SIZE: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, QUANT: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SCALE_ROWS: tl.constexpr = False, HAS_SINKS: tl.constexpr = False,
):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)       # heavy tiles (late in a chunk) launch first
    kv_head = tl.program_id(1)
    seq = _find_chunk(cu_q_ptr, tile, num_seqs, BLOCK_Q)
    chunk_start = tl.load(cu_q_ptr + seq)
    chunk_end = tl.load(cu_q_ptr + seq + 1)
    q0 = chunk_start + (tile - (chunk_start // BLOCK_Q + seq)) * BLOCK_Q
    if q0 < chunk_end:
        seq_len_k = tl.load(seq_lens_ptr + seq)
        history = seq_len_k - (chunk_end - chunk_start)
        r = tl.arange(0, BLOCK_Q * BLOCK_G)
        q_idx = q0 + r // BLOCK_G                                                # [BLOCK_M] token
        g = r % BLOCK_G
        row_mask = (q_idx < chunk_end) & (g < group_size)
        heads = kv_head * group_size + g
        q_pos = history + (q_idx - chunk_start)                                  # [BLOCK_M] absolute
        d = tl.arange(0, BLOCK_D)
        d_mask = d < head_dim
        q_off = q_idx.to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        slope = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
        if HAS_ALIBI:
            slope = tl.load(alibi_ptr + heads, mask=row_mask, other=0.0) * 1.4426950408889634

        first_pos = history + (q0 - chunk_start)
        kv_end = history + tl.minimum(q0 + BLOCK_Q, chunk_end) - chunk_start   # last query pos + 1
        m = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
        table = block_tables_ptr + seq * stride_bt
        k_base = k_cache_ptr + kv_head * stride_kh
        v_base = v_cache_ptr + kv_head * stride_vh
        if HAS_WINDOW:
            masked_from = tl.maximum(first_pos - sliding_window + 1, 0) // BLOCK_N * BLOCK_N
        else:
            masked_from = (first_pos + 1) // BLOCK_N * BLOCK_N                   # tiles below: all visible
            for n0 in range(0, masked_from, BLOCK_N):
                m, l, acc = attend_tile(q, m, l, acc, n0, k_base, v_base, table, q_pos, slope, kv_end,
                                         stride_kb, stride_ks, stride_vb, stride_vs,
                                         sliding_window, scale_log2, softcap, d, d_mask,
                                         k_scale_ptr + kv_head, v_scale_ptr + kv_head, stride_sb, stride_ss,
                                         BLOCK_SIZE, False, HAS_ALIBI, HAS_WINDOW, IEEE, HAS_SOFTCAP, QUANT, BLOCK_N,
                                         FULL=True, SCALE_ROWS=SCALE_ROWS)
        for n0 in range(masked_from, kv_end, BLOCK_N):
            m, l, acc = attend_tile(q, m, l, acc, n0, k_base, v_base, table, q_pos, slope, kv_end,
                                     stride_kb, stride_ks, stride_vb, stride_vs,
                                     sliding_window, scale_log2, softcap, d, d_mask,
                                     k_scale_ptr + kv_head, v_scale_ptr + kv_head, stride_sb, stride_ss,
                                     BLOCK_SIZE, True, HAS_ALIBI, HAS_WINDOW, IEEE, HAS_SOFTCAP, QUANT, BLOCK_N,
                                     SCALE_ROWS=SCALE_ROWS)
        if HAS_SINKS:   # one more logit per head (base 2, as m), with no value row: only the denominator grows
            l += tl.math.exp2(tl.load(sinks_ptr + heads, mask=row_mask, other=0.0) * 1.4426950408889634 - m)
        o = acc / tl.where(l > 0, l, 1.0)[:, None]
        o_off = q_idx.to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


LARGE_CHUNK_TOKENS = 4096   # from this many query tokens a step is a long prefill: bigger tiles pay


@functools.lru_cache(maxsize=None)
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def prefill_config(head_dim: int, group: int, dtype: torch.dtype, on_gpu: bool, large: bool = False) -> dict:
    """Tile sizes: BLOCK_M = BLOCK_Q * BLOCK_G rows (128 on GPU for 16-bit data and head_dim <= 128,
    64 for float32 or larger heads to fit shared memory; 32 under the interpreter).

    ``large`` (a step of >= LARGE_CHUNK_TOKENS query tokens on a Hopper GPU, 16-bit, head_dim <= 128):
    BLOCK_M 256, BLOCK_N 64, 8 warps, 3 stages, the best configuration of the H100 sweep of 2026-11-22
    (``benchmarks/kernel_sweep.py``, 32 query / 8 KV heads, head_dim 128, bf16): 1.33x the small-tile
    default on an 8k chunk without history and 1.27x with an 8k history."""
    block_g = triton.next_power_of_2(group)
    wide = head_dim <= 128 and dtype != torch.float32
    block_m = (128 if wide else 64) if on_gpu else 32
    if on_gpu and wide and large:
        block_m = 256
    huge = on_gpu and head_dim > 256          # Gemma 4's 512: smaller tiles, one stage (shared memory); never run
    if huge:                                   # on a GPU yet
        block_m = 32
    block_q = max(1, block_m // block_g, 16 // block_g)
    return dict(BLOCK_Q=block_q, BLOCK_G=block_g, BLOCK_N=(64 if wide else 32) if on_gpu else 32,
                BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                num_warps=(8 if head_dim > 64 else 4) if on_gpu else 4,
                num_stages=1 if huge else 3 if on_gpu and wide and large else 2)


def paged_prefill_triton(q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, scale,
                         alibi_slopes=None, out=None, *, sliding_window=None, config=None, logit_softcap=None,
                         k_scale=None, v_scale=None, sinks=None):
    """Launch the prefill kernel. Shapes as in ``pagedray.kernels.paged_prefill``; ``config`` overrides
    entries of ``prefill_config`` (the benchmark's ``--sweep`` uses it); ``k_scale`` / ``v_scale``: an 8-bit
    cache's row scales, applied to the K / V rows before the products for bf16 and fp32 queries
    (``tile_triton``'s ``SCALE_ROWS``), to the scores and probabilities for float16 ones, whose range the scaled
    rows of small values would leave). ``sinks`` [num_q_heads] float32: gpt-oss's sink logits."""
    total_q, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    num_seqs = seq_lens_k.shape[0]
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if total_q == 0 or num_seqs == 0:
        return out
    large = q.is_cuda and total_q >= LARGE_CHUNK_TOKENS and _is_hopper(q.device.index or 0)
    cfg = {**prefill_config(head_dim, group, q.dtype, q.is_cuda, large), **(config or {})}
    grid = (total_q // cfg["BLOCK_Q"] + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens_k, cu_seqlens_q,
        alibi_slopes if alibi_slopes is not None else q, out, *scale_args(k_scale, v_scale, q),
        float(scale) * LOG2E, float(logit_softcap or 1.0), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        num_seqs, head_dim, group, sliding_window or 0, sinks if sinks is not None else q,
        BLOCK_SIZE=block_size, HAS_SINKS=sinks is not None, HAS_ALIBI=alibi_slopes is not None,
        HAS_WINDOW=sliding_window is not None,
        IEEE=q.dtype == torch.float32, HAS_SOFTCAP=logit_softcap is not None, QUANT=k_scale is not None,
        SCALE_ROWS=k_scale is not None and q.dtype != torch.float16, **cfg,   # float16's range: scores scaled
    )
    return out
