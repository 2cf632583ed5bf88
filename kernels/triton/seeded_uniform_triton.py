"""Triton counter-based uniform noise for seeded sampling rows (the twin of ``seeded_uniform_reference``).

``keys [rows, 2]`` int64 (two 32-bit halves per row, each in ``[0, 2**32)``) -> ``out [rows, vocab]``
float32 in ``[0, 1)``: ``out[r, c] = (h >> 8) * 2**-24`` with ``h = mix(mix(c + mix(k0)) ^ mix(k1 ^ GOLDEN))``
in uint32 arithmetic (``mix`` is a 32-bit avalanche hash: xor-shift 16, multiply, xor-shift 15,
multiply, xor-shift 15). Every value is a 24-bit fraction, exact in float32, so the kernel and the torch
reference agree bit for bit.

Decisions: docs/design/kernels.md, ``pagedray.kernels.triton.seeded_uniform_triton``.
"""

from __future__ import annotations

import triton
import triton.language as tl

# constexpr globals: a jitted function may read a module global only when it is one (Triton 3.6 refuses
# plain ints at compile time; the interpreter accepts both). ``.value`` is the int for torch code.
MIX_MUL_1 = tl.constexpr(0x21F0AAAD)   # both multipliers < 2**31: the int64 torch reference never overflows
MIX_MUL_2 = tl.constexpr(0x735A2D97)
GOLDEN = tl.constexpr(0x9E3779B9)


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * MIX_MUL_1
    x = x ^ (x >> 15)
    x = x * MIX_MUL_2
    return x ^ (x >> 15)


@triton.jit
def _seeded_uniform_kernel(keys_ptr, out_ptr, stride_out, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)                         # [BLOCK] int32
    k0 = tl.load(keys_ptr + row * 2).to(tl.uint32)
    k1 = tl.load(keys_ptr + row * 2 + 1).to(tl.uint32)
    row_a = _mix32(k0)
    row_b = _mix32(k1 ^ GOLDEN)
    h = _mix32(_mix32(cols.to(tl.uint32) + row_a) ^ row_b)                        # [BLOCK] uint32
    uniform = (h >> 8).to(tl.float32) * (1.0 / 16777216.0)
    tl.store(out_ptr + row * stride_out + cols, uniform, mask=cols < vocab)


def seeded_uniform_triton(keys, out) -> None:
    """keys [rows, 2] int64 (contiguous) -> out [rows, vocab] float32 (columns contiguous)."""
    rows, vocab = out.shape
    if rows == 0 or vocab == 0:
        return
    block = min(triton.next_power_of_2(vocab), 1024)
    grid = (rows, triton.cdiv(vocab, block))
    _seeded_uniform_kernel[grid](keys, out, out.stride(0), vocab, BLOCK=block, num_warps=4)
