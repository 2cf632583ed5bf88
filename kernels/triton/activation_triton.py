"""Triton SiLU-and-multiply for the merged gate/up projection.

``gate_up [tokens, 2 * inter]`` (gate columns first, then up; any token stride, columns contiguous)
-> ``out [tokens, inter]``. One read of each input element, one write of each output element; the
``[tokens, inter]`` intermediate ``silu(gate)`` of the torch formula never touches memory.

Decisions: docs/design/kernels.md, ``pagedray.kernels.triton.activation_triton``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_gt, stride_ot, inter, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)                        # [BLOCK]
    mask = cols < inter
    gate = tl.load(gate_up_ptr + token * stride_gt + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + token * stride_gt + inter + cols, mask=mask, other=0.0)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + cols, (silu * up.to(tl.float32)).to(dtype), mask=mask)


def silu_and_mul_config(inter: int) -> dict:
    block = min(triton.next_power_of_2(inter), 1024)
    return dict(BLOCK=block, num_warps=max(1, block // 256))


def silu_and_mul_triton(gate_up, out) -> None:
    """gate_up [tokens, 2 * inter] -> out [tokens, inter] (columns contiguous in both)."""
    num_tokens, inter = out.shape
    if num_tokens == 0 or inter == 0:
        return
    cfg = silu_and_mul_config(inter)
    grid = (num_tokens, triton.cdiv(inter, cfg["BLOCK"]))
    _silu_and_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), inter, **cfg)
