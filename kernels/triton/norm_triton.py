"""Triton RMSNorm over the last dim, with an optional fused residual add.

Rows are addressed as ``[tokens, heads, size]`` with free token and head strides and ``size``
contiguous, so one kernel serves the hidden-state norm (``[tokens, hidden]``, one "head" per token) and
Qwen3's per-head q/k norm on a strided view ``qkv[:, :Hq]`` (token stride ``(Hq + 2 Hkv) * D``).

Decisions: docs/design/kernels.md, ``pagedray.kernels.triton.norm_triton``.
"""

from __future__ import annotations

import triton
import triton.language as tl

MAX_SIZE = 32768        # one row per register tile


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
    stride_xt, stride_xh, stride_rt, stride_rh, stride_ot, stride_oh, stride_nt, stride_nh,
    num_heads, size, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]              # [BLOCK_H, 1]
    d = tl.arange(0, BLOCK_D)[None, :]                                            # [1, BLOCK_D]
    mask = (h < num_heads) & (d < size)
    x = tl.load(x_ptr + token * stride_xt + h * stride_xh + d, mask=mask, other=0.0)   # [BLOCK_H, BLOCK_D]
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + token * stride_rt + h * stride_rh + d, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)                     # the new residual
        tl.store(new_res_ptr + token * stride_nt + h * stride_nh + d, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_sq = tl.sum(x32 * x32, axis=1) / size                                    # [BLOCK_H]
    normed = (x32 * tl.rsqrt(mean_sq + eps)[:, None]).to(dtype)
    w = tl.load(w_ptr + d, mask=d < size, other=0.0)                              # [1, BLOCK_D]
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(dtype)
    tl.store(out_ptr + token * stride_ot + h * stride_oh + d, y, mask=mask)


def norm_config(num_heads: int, size: int) -> dict:
    """Tile ``[BLOCK_H, BLOCK_D]`` (<= 4096 elements unless one row is longer) and about 16 elements
    per thread."""
    block_d = triton.next_power_of_2(size)
    block_h = min(triton.next_power_of_2(num_heads), max(1, 4096 // block_d))
    return dict(BLOCK_H=block_h, BLOCK_D=block_d, num_warps=max(1, min(16, block_h * block_d // 512)))


def _rows(t):
    """(token stride, head stride) of a [tokens, size] or [tokens, heads, size] tensor."""
    return (t.stride(0), t.stride(1)) if t.dim() == 3 else (t.stride(0), 0)


def rms_norm_triton(x, weight, eps: float, residual, out, new_residual) -> None:
    """x/residual/out/new_residual [tokens, size] or [tokens, heads, size] (size contiguous); weight [size].

    Writes norm(x [+ residual]) into ``out`` and, with ``residual``, x + residual into ``new_residual``.
    """
    num_tokens, size = x.shape[0], x.shape[-1]
    num_heads = x.shape[1] if x.dim() == 3 else 1
    if num_tokens == 0 or num_heads == 0:
        return
    has_residual = residual is not None
    res, new_res = (residual, new_residual) if has_residual else (x, out)    # placeholders, never read
    cfg = norm_config(num_heads, size)
    grid = (num_tokens, triton.cdiv(num_heads, cfg["BLOCK_H"]))
    _rms_norm_kernel[grid](
        x, res, weight, out, new_res,
        *_rows(x), *_rows(res), *_rows(out), *_rows(new_res),
        num_heads, size, eps, HAS_RESIDUAL=has_residual, **cfg,
    )
