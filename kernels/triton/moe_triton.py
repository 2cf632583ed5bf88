"""Triton fused mixture-of-experts: the routed (token, slot) rows sorted by expert, one grouped GEMM launch
for every expert's gate / up projection and one for its down projection, the top-k weight applied in the
second GEMM's epilogue.

``align_by_expert`` lists the rows ``token * top_k + slot`` grouped by expert, each expert's group padded to
a multiple of ``BLOCK_M`` with a sentinel (``tokens * top_k``, never stored), and the expert of each
``BLOCK_M`` block (experts that got no row get no block; the list has a fixed worst-case length whose
unused blocks say -1 and return at once, so nothing is read back to the host). ``_grouped_gemm_kernel``
computes, for one block of rows and ``BLOCK_N`` output columns, ``a[row] @ w[expert]^T`` (``a``'s row: the
token's row of x for the first GEMM, the routed row itself for the second), accumulating in float32; with
``MUL_WEIGHT`` each row is scaled by its top-k weight. The caller sums the ``top_k`` rows of each token.

Packed experts (``quant_gemm.PackedExperts``: a GPTQ / AWQ / int8 / FP8 / MXFP4 checkpoint's experts on CUDA):
``_grouped_packed_gemm_kernel`` is the same grouped GEMM whose weight tile is unpacked and dequantized from
the expert's words by ``quant_gemm_triton``'s helpers (each word loaded once; up to 16 tokens one ``tl.dot``
per position in the word, above that the slice unpacked in row order for one ``tl.dot``: ``WIDE``), so the
experts stay 4 or 8 bits a weight in memory.

Decisions: docs/design/kernels.md, ``pagedray.kernels.triton.moe_triton``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant_gemm_triton import _dequantize, _group_params, _unpack_in_order, _word_tile


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """topk_ids [T, k] -> (sorted_rows [P] int32 with sentinel T*k, block_experts [P / block_m] int32, -1 for
    the blocks past the last expert's). P is the bound T*k + E*(block_m - 1) rounded up to block_m, so the
    shapes depend on T, k and E only: no value reaches the host (the step can be a CUDA graph)."""
    flat = topk_ids.reshape(-1).to(torch.int64)                                   # [T*k]
    rows = flat.numel()
    order = torch.argsort(flat, stable=True)                                     # rows grouped by expert
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))                                          # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded                                                       # each expert's first slot
    total = -(-(rows + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_rows = torch.full((total,), rows, dtype=torch.int32, device=flat.device)
    expert_of = flat[order]
    within = torch.arange(rows, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert_of]
    sorted_rows[starts[expert_of] + within] = order.to(torch.int32)
    block_starts = torch.arange(0, total, block_m, device=flat.device)
    block_experts = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)   # E past the end
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return sorted_rows, block_experts


@triton.jit
def _dot_add(acc, a, w, IEEE: tl.constexpr):
    """acc + a @ w in float32; float32 inputs stay float32 (tl.dot would round them to TF32 on CUDA)."""
    if IEEE:
        return acc + tl.dot(a, w, input_precision="ieee")
    return acc + tl.dot(a, w)


@triton.jit
def _store_rows(acc, out_ptr, weight_ptr, rows, real, cols, n_mask, stride_out, MUL_WEIGHT: tl.constexpr):
    """The routed rows' outputs [BLOCK_M, BLOCK_N] (times each row's top-k weight with ``MUL_WEIGHT``)."""
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + rows, mask=real, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=real[:, None] & n_mask[None, :])


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, out_ptr, weight_ptr, rows_ptr, experts_ptr,
                         num_rows, n_out, k_in, top_k, stride_a, stride_we, stride_wn, stride_out,
                         A_BY_TOKEN: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    block = tl.program_id(0)
    col0 = tl.program_id(1) * BLOCK_N
    expert = tl.load(experts_ptr + block).to(tl.int64)
    if expert < 0:                                   # a block past the last expert's rows
        return
    rows = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)   # [BLOCK_M] routed rows
    real = rows < num_rows
    a_rows = rows // top_k if A_BY_TOKEN else rows                                 # x's row, or the routed row
    cols = col0 + tl.arange(0, BLOCK_N)                                            # [BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :],
                    mask=real[:, None] & (ks[None, :] < k_in), other=0.0)         # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None],
                    mask=(cols[None, :] < n_out) & (ks[:, None] < k_in), other=0.0)   # [BLOCK_K, BLOCK_N]
        acc = _dot_add(acc, a, w, IEEE)
    _store_rows(acc, out_ptr, weight_ptr, rows, real, cols, cols < n_out, stride_out, MUL_WEIGHT)


@triton.jit
def _grouped_packed_gemm_kernel(a_ptr, qw_ptr, zeros_ptr, scales_ptr, gidx_ptr, out_ptr, weight_ptr, rows_ptr,
                                experts_ptr, num_rows, n_out, k_in, top_k, group_size, stride_a, stride_qe, stride_qk,
                                stride_ze, stride_zg, stride_se, stride_sg, stride_out,
                                BITS: tl.constexpr, FLOAT8: tl.constexpr, GROUPED: tl.constexpr,
                                A_BY_TOKEN: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
                                WIDE: tl.constexpr, LOG2_PER_WORD: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr):
    """``_grouped_gemm_kernel`` over packed experts: K slices of BLOCK_KW word rows (BLOCK_KW * 32 / BITS
    weight rows); with ``GROUPED`` a slice lies in one group (one row of zero points and scales). With
    ``WIDE`` a slice is unpacked in row order and multiplied in one ``tl.dot`` (large row blocks), else one
    ``tl.dot`` per position in the word (x's columns strided by PER_WORD)."""
    PER_WORD: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    block = tl.program_id(0)
    expert = tl.load(experts_ptr + block).to(tl.int64)
    if expert < 0:                                   # a block past the last expert's rows
        return
    rows = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)   # [BLOCK_M] routed rows
    real = rows < num_rows
    a_rows = rows // top_k if A_BY_TOKEN else rows
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                      # [BLOCK_N]
    n_mask = cols < n_out
    qw, zp, sp = qw_ptr + expert * stride_qe, zeros_ptr + expert * stride_ze, scales_ptr + expert * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(0, tl.cdiv(k_in, BLOCK_KW * PER_WORD)):
        k0 = s * BLOCK_KW * PER_WORD
        rw = s * BLOCK_KW + tl.arange(0, BLOCK_KW)                                  # [BLOCK_KW] word rows
        words = _word_tile(qw, rw, cols, k_in // PER_WORD, n_mask, stride_qk)      # [BLOCK_KW, BLOCK_N]
        if WIDE:
            rk = k0 + tl.arange(0, BLOCK_KW * PER_WORD)                              # [BLOCK_K] weight rows
            k_mask = rk < k_in
            zeros, scales = _group_params(zp, sp, gidx_ptr, rk, cols, k0, group_size, k_mask, n_mask, stride_zg,
                                          stride_sg, GROUPED)
            a = tl.load(a_ptr + a_rows[:, None] * stride_a + rk[None, :], mask=real[:, None] & k_mask[None, :],
                        other=0.0)                                                  # [BLOCK_M, BLOCK_K]
            codes = _unpack_in_order(words, BITS, LOG2_PER_WORD)                    # [BLOCK_K, BLOCK_N]
            acc = _dot_add(acc, a, _dequantize(codes, zeros, scales, FLOAT8).to(a_ptr.dtype.element_ty), IEEE)
        else:
            if GROUPED:
                zeros, scales = _group_params(zp, sp, gidx_ptr, rw, cols, k0, group_size, rw >= 0, n_mask, stride_zg,
                                              stride_sg, GROUPED)
            for j in tl.static_range(PER_WORD):
                rk = rw * PER_WORD + j                                                  # [BLOCK_KW] weight rows
                k_mask = rk < k_in
                if not GROUPED:
                    zeros, scales = _group_params(zp, sp, gidx_ptr, rk, cols, k0, group_size, k_mask, n_mask, stride_zg,
                                                  stride_sg, GROUPED)
                a = tl.load(a_ptr + a_rows[:, None] * stride_a + rk[None, :], mask=real[:, None] & k_mask[None, :],
                            other=0.0)                                                  # [BLOCK_M, BLOCK_KW]
                w = _dequantize((words >> (j * BITS)) & MASK, zeros, scales, FLOAT8).to(a_ptr.dtype.element_ty)
                acc = _dot_add(acc, a, w, IEEE)
    _store_rows(acc, out_ptr, weight_ptr, rows, real, cols, n_mask, stride_out, MUL_WEIGHT)


def moe_config(tokens: int, packed: bool = False) -> dict:
    """Row blocks of 16 at decode sizes, 64 for long prefill steps. Packed experts (H200 sweep, docs/gpu.md):
    up to 16 tokens one product per position in the word over 64 columns (at one token the wide form over
    128 columns took 0.73 ms against 0.53); above, slices unpacked in row order (``WIDE``) over 128 columns
    (256 to 4,095 tokens: 1.0-1.3x bf16 where the per-position form ran 0.26-0.48x), and row blocks of 128
    with 8 warps from 4,096 tokens."""
    if not packed:
        return dict(BLOCK_M=16 if tokens <= 64 else 64, BLOCK_N=64, BLOCK_K=32)
    if tokens <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, num_warps=4, WIDE=False)
    if tokens >= 4096:
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=8, WIDE=True)
    return dict(BLOCK_M=16 if tokens <= 64 else 64, BLOCK_N=128, BLOCK_K=32, num_warps=4, WIDE=True)


def _grouped_gemm(a, w, out, weights, sorted_rows, block_experts, top_k, a_by_token, cfg) -> None:
    n_out, k_in = w.shape[1], w.shape[2]
    grid = (block_experts.shape[0], triton.cdiv(n_out, cfg["BLOCK_N"]))
    if not isinstance(w, torch.Tensor):   # quant_gemm.PackedExperts (fused_ops checked which it is)
        block_kw = 16                                                        # tl.dot's smallest K
        grouped = w.group_size % (block_kw * (32 // w.bits)) == 0
        _grouped_packed_gemm_kernel[grid](
            a, w.qweight, w.zeros, w.scales, w.g_idx, out, weights, sorted_rows, block_experts, out.shape[0], n_out,
            k_in, top_k, w.group_size, a.stride(0), w.qweight.stride(0), w.qweight.stride(1), w.zeros.stride(0),
            w.zeros.stride(1), w.scales.stride(0), w.scales.stride(1), out.stride(0), BITS=w.bits,
            FLOAT8=2 if w.float4 else int(w.float8),
            GROUPED=grouped, A_BY_TOKEN=a_by_token, MUL_WEIGHT=weights is not None, IEEE=a.dtype == torch.float32,
            WIDE=cfg["WIDE"], LOG2_PER_WORD=(32 // w.bits).bit_length() - 1,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_KW=block_kw, num_warps=cfg["num_warps"])
        return
    _grouped_gemm_kernel[grid](a, w, out, weights, sorted_rows, block_experts, out.shape[0], n_out, k_in, top_k,
                               a.stride(0), w.stride(0), w.stride(1), out.stride(0), A_BY_TOKEN=a_by_token,
                               MUL_WEIGHT=weights is not None, IEEE=a.dtype == torch.float32,
                               BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"])


def fused_moe_triton(x, gate_up, down, topk_weights, topk_ids, glu=None, gate_up_bias=None, down_bias=None
                     ) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H]; down [E, H, I] (tensors, or both ``PackedExperts`` of those shapes);
    topk_weights [T, k]; topk_ids [T, k]; optional gate_up_bias [E, 2I], down_bias [E, H] -> [T, H] (x.dtype): sum
    over the k picks of weight * (down(glu(gate, up)) + down_bias) (``reference.fused.fused_moe_reference``;
    ``glu``: elementwise torch between the two grouped GEMMs, ``act(gate) * up`` with SiLU by default; the biases
    are gathered by each routed row's expert, so nothing reaches the host)."""
    tokens, top_k = topk_ids.shape
    num_experts, two_inter, _ = gate_up.shape
    cfg = moe_config(tokens, packed=not isinstance(gate_up, torch.Tensor))   # PackedExperts otherwise
    sorted_rows, block_experts = align_by_expert(topk_ids, num_experts, cfg["BLOCK_M"])
    routed = torch.empty((tokens * top_k, two_inter), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, gate_up, routed, None, sorted_rows, block_experts, top_k, True, cfg)
    expert_of_row = topk_ids.reshape(-1)                                         # [T*k]: row token * k + slot
    if gate_up_bias is not None:
        routed += gate_up_bias[expert_of_row]
    gate, up = routed.chunk(2, dim=-1)
    hidden = (glu(gate, up) if glu is not None else torch.nn.functional.silu(gate) * up).contiguous()   # [T*k, I]
    per_pick = torch.empty((tokens * top_k, x.shape[1]), dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    _grouped_gemm(hidden, down, per_pick, weights, sorted_rows, block_experts, top_k, False, cfg)
    if down_bias is not None:
        per_pick += down_bias[expert_of_row] * weights[:, None]
    return per_pick.view(tokens, top_k, -1).sum(dim=1)
