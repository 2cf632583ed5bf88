"""Triton GEMM over packed integer weights (GPTQ / AWQ 4-bit, 8-bit), dequantized tile by tile.

``y [M, N] = x[:, perm] [M, K] @ W^T`` with ``W^T [K, N]`` held as ``qweight`` int32 ``[K / per_word, N]``
(GPTQ's layout: a word holds ``per_word = 32 / bits`` consecutive K rows, lowest bits first), zero points
int32 ``[groups, N]``, scales ``[groups, N]``, ``g_idx`` int32 ``[K]`` (row -> group) and ``perm`` int32
``[K]`` or None (row k multiplies x's column ``perm[k]``; ``kernels.quant_gemm.group_rows`` sorts an
activation-order checkpoint's rows by group at load and records the permutation here).

A K slice is ``BLOCK_KW`` word rows (``BLOCK_KW * per_word`` weight rows): its words are loaded once
(``_word_tile``), then for each position j within a word the rows ``word * per_word + j`` are unpacked,
their zero points subtracted and their scales applied in float32 (``_group_params``), cast to x's dtype.
With ``FLOAT8`` (8-bit codes that are float8 e4m3 bit patterns: FP8 checkpoints and ``quantization`` fp8) a
code's value is its e4m3 number (``_e4m3_to_f32``, exact) times the scale, and the zero points are not read.

* ``_quant_gemm_kernel`` (decode-sized M): a program owns a ``[BLOCK_M, BLOCK_N]`` output tile and one of
  ``SPLIT_K`` consecutive ranges of K slices, accumulating ``tl.dot`` in float32 (IEEE products for float32
  inputs) against x's matching columns. With ``GROUPED`` (``group_size`` > 0: ``g_idx[k] == k //
  group_size``, a multiple of the slice's rows) a slice lies in one group, so its zero points and scales are
  one row each; otherwise every row's group is read from ``g_idx``. With ``SPLIT_K`` > 1 each range writes a
  float32 partial ``[SPLIT_K, M, N]`` that torch sums (deterministic: no atomics, a run repeats bit for bit).
* ``_dequant_kernel`` (larger M): writes ``W^T`` in x's dtype once, then cuBLAS multiplies; there,
  re-dequantizing the weight for every row tile costs more than the dense GEMM (H100 measurements in
  docs/gpu.md set ``DENSE_ABOVE_ROWS``).

``quant_gemm_config`` picks the tiles, the split and the path; ``benchmarks.quant_gemm`` measures them
against a dense bf16 ``F.linear`` (and sweeps the alternatives) on a GPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

DENSE_ABOVE_ROWS = {4: 16, 8: 16}    # by bits: M above this dequantizes once, then cuBLAS (docs/gpu.md)


@triton.jit
def _word_tile(qw_ptr, rw, rn, num_words, n_mask, stride_qk):
    """The packed words of word rows ``rw`` x columns ``rn`` -> int32 [BLOCK_KW, BLOCK_N], each loaded once."""
    return tl.load(qw_ptr + rw[:, None].to(tl.int64) * stride_qk + rn[None, :],
                   mask=(rw < num_words)[:, None] & n_mask[None, :], other=0)


@triton.jit
def _unpack_in_order(words, BITS: tl.constexpr, LOG2_PER_WORD: tl.constexpr):
    """Words [BLOCK_KW, BLOCK_N] -> codes int32 [BLOCK_KW * PER_WORD, BLOCK_N] in weight-row order (row
    ``word * PER_WORD + j`` is bits ``[j * BITS, (j + 1) * BITS)`` of its word): each word repeated PER_WORD
    times by interleaving it with itself, then shifted by its position, so one ``tl.dot`` covers the slice."""
    rep = tl.trans(words)                                                        # [BLOCK_N, BLOCK_KW]
    for _ in tl.static_range(LOG2_PER_WORD):
        rep = tl.interleave(rep, rep)                                            # each word twice, in place
    rep = tl.trans(rep)                                                          # [BLOCK_KW * PER_WORD, BLOCK_N]
    shifts = (tl.arange(0, rep.shape[0]) % (32 // BITS)) * BITS
    return (rep >> shifts[:, None]) & ((1 << BITS) - 1)


@triton.jit
def _e4m3_to_f32(codes):
    """int32 codes in [0, 256), float8 e4m3fn bit patterns -> their values as float32, exactly: the sign and
    the 7 exponent / mantissa bits placed into a float16 (exponent bias 15 against e4m3's 7) times 2^8, which
    keeps e4m3's subnormals exact (float16 subnormals are not flushed)."""
    half = ((codes & 0x80) << 8) | ((codes & 0x7F) << 7)
    return half.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _e2m1_to_f32(codes):
    """int32 codes in [0, 16), float4 e2m1 bit patterns (MXFP4's: a sign, 2 exponent bits, 1 mantissa bit) ->
    their values as float32, exactly (0, 0.5, 1, 1.5, 2, 3, 4, 6 and the negatives): as ``_e4m3_to_f32``, the bits
    placed into a float16 (exponent bias 15 against e2m1's 1) times 2^14, which keeps e2m1's one subnormal (0.5)."""
    half = ((codes & 0x8) << 12) | ((codes & 0x7) << 9)
    return half.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _dequantize(codes, zeros, scales, FLOAT8: tl.constexpr):
    """Codes (int32) with their group's zero points and float32 scales -> float32 weights. ``FLOAT8``: 0 (or
    False) integer codes minus zero points; 1 (True) float8 e4m3 codes; 2 float4 e2m1 codes (packed experts
    only). Float codes read no zero point."""
    if FLOAT8 == 2:
        return _e2m1_to_f32(codes) * scales
    if FLOAT8:
        return _e4m3_to_f32(codes) * scales
    return (codes - zeros).to(tl.float32) * scales


@triton.jit
def _group_params(zeros_ptr, scales_ptr, gidx_ptr, rk, rn, k0, group_size, k_mask, n_mask, stride_zg, stride_sg,
                  GROUPED: tl.constexpr):
    """Zero points and scales (float32) for rows ``rk``: one row [1, BLOCK_N] when the slice lies in one group
    (``GROUPED``), else each row's group's [BLOCK_KW, BLOCK_N]."""
    if GROUPED:
        group = k0 // group_size
        zeros = tl.load(zeros_ptr + group * stride_zg + rn, mask=n_mask, other=0)[None, :]
        scales = tl.load(scales_ptr + group * stride_sg + rn, mask=n_mask, other=0.0)[None, :]
    else:
        group = tl.load(gidx_ptr + rk, mask=k_mask, other=0).to(tl.int64)        # [BLOCK_KW]
        kn_mask = k_mask[:, None] & n_mask[None, :]
        zeros = tl.load(zeros_ptr + group[:, None] * stride_zg + rn[None, :], mask=kn_mask, other=0)
        scales = tl.load(scales_ptr + group[:, None] * stride_sg + rn[None, :], mask=kn_mask, other=0.0)
    return zeros, scales.to(tl.float32)


@triton.jit
def _quant_gemm_kernel(x_ptr, perm_ptr, qw_ptr, zeros_ptr, scales_ptr, gidx_ptr, out_ptr, M, N, K, group_size,
                       slices_per_split, stride_xm, stride_qk, stride_zg, stride_sg, stride_os, stride_om,
                       BITS: tl.constexpr, IEEE: tl.constexpr, GROUPED: tl.constexpr, HAS_PERM: tl.constexpr,
                       FLOAT8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr):
    """A K slice is BLOCK_KW word rows (BLOCK_KW * PER_WORD weight rows): the words are loaded once, then for
    each position j in the word the rows ``word * PER_WORD + j`` are unpacked and multiplied with x's matching
    columns (strided loads of the small x)."""
    PER_WORD: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)                     # [BLOCK_M]
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                     # [BLOCK_N]
    split = tl.program_id(2)
    m_mask, n_mask = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = split * slices_per_split
    last = tl.minimum(first + slices_per_split, tl.cdiv(K, BLOCK_KW * PER_WORD))
    for s in range(first, last):
        k0 = s * BLOCK_KW * PER_WORD
        rw = s * BLOCK_KW + tl.arange(0, BLOCK_KW)                               # [BLOCK_KW] word rows
        words = _word_tile(qw_ptr, rw, rn, K // PER_WORD, n_mask, stride_qk)    # [BLOCK_KW, BLOCK_N]
        if GROUPED:
            zeros, scales = _group_params(zeros_ptr, scales_ptr, gidx_ptr, rw, rn, k0, group_size, rw >= 0,
                                          n_mask, stride_zg, stride_sg, GROUPED)
        for j in tl.static_range(PER_WORD):
            rk = rw * PER_WORD + j                                               # [BLOCK_KW] weight rows
            k_mask = rk < K
            if not GROUPED:
                zeros, scales = _group_params(zeros_ptr, scales_ptr, gidx_ptr, rk, rn, k0, group_size, k_mask,
                                              n_mask, stride_zg, stride_sg, GROUPED)
            if HAS_PERM:
                cols = tl.load(perm_ptr + rk, mask=k_mask, other=0)
            else:
                cols = rk
            x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + cols[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)       # [BLOCK_M, BLOCK_KW]
            codes = (words >> (j * BITS)) & MASK
            w = _dequantize(codes, zeros, scales, FLOAT8).to(x_ptr.dtype.element_ty)    # [BLOCK_KW, BLOCK_N]
            if IEEE:
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w)
    tl.store(out_ptr + split.to(tl.int64) * stride_os + rm[:, None].to(tl.int64) * stride_om + rn[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _dequant_kernel(qw_ptr, zeros_ptr, scales_ptr, gidx_ptr, out_ptr, N, K, group_size, stride_qk, stride_zg,
                    stride_sg, stride_ok, BITS: tl.constexpr, GROUPED: tl.constexpr, FLOAT8: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr):
    """W^T [K, N] in out's dtype, BLOCK_KW word rows x BLOCK_N columns per program."""
    PER_WORD: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    k0 = tl.program_id(0) * BLOCK_KW * PER_WORD
    rw = tl.program_id(0) * BLOCK_KW + tl.arange(0, BLOCK_KW)                   # [BLOCK_KW]
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                     # [BLOCK_N]
    n_mask = rn < N
    words = _word_tile(qw_ptr, rw, rn, K // PER_WORD, n_mask, stride_qk)
    for j in tl.static_range(PER_WORD):
        rk = rw * PER_WORD + j
        k_mask = rk < K
        zeros, scales = _group_params(zeros_ptr, scales_ptr, gidx_ptr, rk, rn, k0, group_size, k_mask, n_mask,
                                      stride_zg, stride_sg, GROUPED)
        w = _dequantize((words >> (j * BITS)) & MASK, zeros, scales, FLOAT8).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rk[:, None].to(tl.int64) * stride_ok + rn[None, :], w,
                 mask=k_mask[:, None] & n_mask[None, :])


@functools.lru_cache(maxsize=None)
def _num_programs_wanted(device: torch.device) -> int:
    """Three programs per SM on CUDA; a small fixed number under the interpreter (so tests split K)."""
    if device.type == "cuda":
        return 3 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


WIDE_COLUMNS_FROM = 8192     # N from which a program owns 256 output columns (else 128)


def quant_gemm_config(m: int, n: int, k: int, group_size: int, bits: int, device: torch.device,
                      dense_above: int | None = None) -> dict:
    """Tiles and path for x [m, k] @ W^T [k, n]: ``dense`` above ``dense_above`` rows (default
    ``DENSE_ABOVE_ROWS[bits]``); else 16 / 32 / 64-row tiles, 128 columns (256 from ``WIDE_COLUMNS_FROM``), K
    slices of 16 word rows (``GROUPED`` when ``group_size`` is a multiple of the slice's weight rows), and K
    split in powers of two until the grid has ``_num_programs_wanted`` programs (each range keeping at least
    two slices). Set from the H100 sweep of every column tile x split (docs/gpu.md): at K 4096 and M 1 / 16
    this rule's setting ran within 9% of the best of 24 in each of 12 cases (4-bit, 8-bit, FP8 x N 4096 /
    14336), where 64 columns and two programs per SM ran up to 1.66x slower."""
    block_kw = 16                                             # tl.dot's smallest K
    slice_rows = block_kw * (32 // bits)
    grouped = group_size > 0 and group_size % slice_rows == 0
    if m > (DENSE_ABOVE_ROWS[bits] if dense_above is None else dense_above):
        return dict(dense=True, GROUPED=grouped, BLOCK_N=64, BLOCK_KW=block_kw)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 256 if n >= WIDE_COLUMNS_FROM else 128
    tiles, slices, split = triton.cdiv(m, block_m) * triton.cdiv(n, block_n), triton.cdiv(k, slice_rows), 1
    while tiles * split < _num_programs_wanted(device) and slices // (split * 2) >= 2:
        split *= 2
    return dict(dense=False, GROUPED=grouped, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KW=block_kw, SPLIT_K=split,
                num_warps=4)


def quant_gemm_triton(x, qweight, zeros, scales, g_idx, bits: int, perm=None, group_size: int = 0,
                      config: dict | None = None, float8: bool = False) -> torch.Tensor:
    """x [M, K] (contiguous rows) -> [M, N] in x.dtype; the packed weight as the module docstring says
    (``float8``: the 8-bit codes are e4m3 bit patterns).
    ``config`` overrides ``quant_gemm_config`` (tests and the benchmark's sweep)."""
    m, k = x.shape
    n = qweight.shape[1]
    if m == 0:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    cfg = dict(config or quant_gemm_config(m, n, k, group_size, bits, x.device))
    slice_rows = cfg["BLOCK_KW"] * (32 // bits)
    if cfg.pop("dense"):
        weight_t = torch.empty((k, n), dtype=x.dtype, device=x.device)                  # [K, N]
        grid = (triton.cdiv(k, slice_rows), triton.cdiv(n, cfg["BLOCK_N"]))
        _dequant_kernel[grid](qweight, zeros, scales, g_idx, weight_t, n, k, group_size, qweight.stride(0),
                              zeros.stride(0), scales.stride(0), weight_t.stride(0), BITS=bits, FLOAT8=float8,
                              **cfg)
        return (x if perm is None else x.index_select(1, perm)) @ weight_t
    split = cfg.pop("SPLIT_K")
    out = (torch.empty((m, n), dtype=x.dtype, device=x.device) if split == 1
           else torch.empty((split, m, n), dtype=torch.float32, device=x.device))
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), split)
    slices_per_split = triton.cdiv(triton.cdiv(k, slice_rows), split)
    _quant_gemm_kernel[grid](x, qweight if perm is None else perm, qweight, zeros, scales, g_idx, out, m, n, k,
                             group_size, slices_per_split, x.stride(0), qweight.stride(0), zeros.stride(0),
                             scales.stride(0), out.stride(0) if split > 1 else 0, out.stride(-2), BITS=bits,
                             IEEE=x.dtype == torch.float32, HAS_PERM=perm is not None, FLOAT8=float8, **cfg)
    return out if split == 1 else out.sum(0).to(x.dtype)
