"""The LoRA product of a step in Triton (CUDA): ``y[t] += scale[s] * (x[t] @ A[s]^T) @ E[s]`` for each token t
whose slot s = slots[t] is >= 0, every adapter of the step in two launches (the BGMV idea: each token reads its
own slot's matrices), with the layout of ``workers/lora/slots.py``: A [S, nr, in], E [S, nr, out].

- shrink: grid (tokens, nr / BLOCK_R); each program sums BLOCK_R rows of its token's A against x, in float32,
  into ``shrunk [tokens, nr]`` (float32);
- expand: grid (tokens, out / BLOCK_N); each program adds ``scale * shrunk[t] @ E[s][:, cols]`` to its
  columns of y. E's rows outside a segment's columns are zero and read anyway (a merged q/k/v reads three
  times the expand it needs; simple first, measured on a GPU later).

Shrink, expand, then the scale: PEFT's order. ``lora_add_triton`` checks its arguments first (ValueError
naming the argument). Tested under the Triton interpreter on CPU against float64 (tests/kernels/
test_lora_triton.py); not run on a GPU yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, shrunk_ptr, stride_x, in_features, nr,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)                     # [BLOCK_R]
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        base = a_ptr + slot * nr * in_features
        for k0 in range(0, in_features, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)                                             # [BLOCK_K]
            xv = tl.load(x_ptr + token * stride_x + ks, mask=ks < in_features, other=0.0).to(tl.float32)
            av = tl.load(base + rows[:, None] * in_features + ks[None, :],
                         mask=(rows[:, None] < nr) & (ks[None, :] < in_features), other=0.0).to(tl.float32)
            acc += tl.sum(av * xv[None, :], axis=1)                                   # [BLOCK_R]
        tl.store(shrunk_ptr + token * nr + rows, acc, mask=rows < nr)


@triton.jit
def _expand_kernel(shrunk_ptr, e_ptr, slots_ptr, scales_ptr, y_ptr, stride_y, nr, out,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                     # [BLOCK_N]
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        base = e_ptr + slot * nr * out
        for r0 in range(0, nr, BLOCK_R):
            rs = r0 + tl.arange(0, BLOCK_R)                                             # [BLOCK_R]
            sv = tl.load(shrunk_ptr + token * nr + rs, mask=rs < nr, other=0.0)
            ev = tl.load(base + rs[:, None] * out + cols[None, :], mask=(rs[:, None] < nr) & (cols[None, :] < out),
                         other=0.0).to(tl.float32)                                      # [BLOCK_R, BLOCK_N]
            acc += tl.sum(sv[:, None] * ev, axis=0)
        scale = tl.load(scales_ptr + slot)
        yv = tl.load(y_ptr + token * stride_y + cols, mask=cols < out, other=0.0)
        tl.store(y_ptr + token * stride_y + cols, (yv.to(tl.float32) + acc * scale).to(yv.dtype), mask=cols < out)


def _check(x, a, e, slots, scales, y) -> None:
    device = x.device
    for name, t in (("a", a), ("e", e), ("slots", slots), ("scales", scales), ("y", y)):
        if t.device != device:
            raise ValueError(f"{name}: must be on x's device {device}, got {t.device}")
    if x.dim() != 2 or y.dim() != 2 or x.stride(1) != 1 or y.stride(1) != 1 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x / y: [tokens, in] and [tokens, out] with contiguous rows, got {tuple(x.shape)} / "
                         f"{tuple(y.shape)}")
    if a.dim() != 3 or e.dim() != 3 or not a.is_contiguous() or not e.is_contiguous() or e.shape[:2] != a.shape[:2] \
            or a.shape[2] != x.shape[1] or e.shape[2] != y.shape[1]:
        raise ValueError(f"a / e: contiguous [slots, nr, in] / [slots, nr, out] for x {tuple(x.shape)} and y "
                         f"{tuple(y.shape)}, got {tuple(a.shape)} / {tuple(e.shape)}")
    if a.dtype != x.dtype or e.dtype != x.dtype or y.dtype != x.dtype:
        raise ValueError(f"a / e / y: must be x's dtype {x.dtype}, got {a.dtype} / {e.dtype} / {y.dtype}")
    if slots.dtype != torch.int32 or tuple(slots.shape) != (x.shape[0],) or not slots.is_contiguous():
        raise ValueError(f"slots: a contiguous int32 vector of {x.shape[0]} slots")
    if scales.dtype != torch.float32 or tuple(scales.shape) != (a.shape[0],) or not scales.is_contiguous():
        raise ValueError(f"scales: a contiguous float32 vector of {a.shape[0]} scales")


def lora_add_triton(x: torch.Tensor, a: torch.Tensor, e: torch.Tensor, slots: torch.Tensor, scales: torch.Tensor,
                    y: torch.Tensor) -> None:
    """y [tokens, out] += per token t with slots[t] >= 0: scales[s] * (x[t] @ a[s]^T) @ e[s], in place; every
    tensor on one device (slots' values, -1 or a slot of ``a``, are the caller's to keep: workers/lora checks
    them once per step)."""
    _check(x, a, e, slots, scales, y)
    tokens, nr, out = x.shape[0], a.shape[1], y.shape[1]
    if tokens == 0:
        return
    shrunk = torch.empty((tokens, nr), dtype=torch.float32, device=x.device)          # [tokens, nr]
    block_r = min(triton.next_power_of_2(nr), 64)
    _shrink_kernel[(tokens, triton.cdiv(nr, block_r))](x, a, slots, shrunk, x.stride(0), x.shape[1], nr,
                                                        BLOCK_R=block_r, BLOCK_K=64)
    block_n = min(triton.next_power_of_2(out), 128)
    _expand_kernel[(tokens, triton.cdiv(out, block_n))](shrunk, e, slots, scales, y, y.stride(0), nr, out,
                                                        BLOCK_N=block_n, BLOCK_R=min(block_r, 32))
