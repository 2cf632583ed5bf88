"""Triton gated delta rule over a step's sequences, reading and writing their states in the pool in place.

One program per (sequence, value head, block of ``BLOCK_V`` value dimensions): it loads its slot's state
columns ``S [Dk, BLOCK_V]`` (float32; zeros for a fresh sequence), runs the recurrence token by token over the
sequence's tokens of the step (``cu_seqlens``), L2-normalising q and k in float32 as the torch reference does,
writes each token's output columns and stores the state back. A decode step is the same launch with one token
per sequence. No host reads, no gather or scatter of the pool: a decode can be captured in a CUDA graph.

This is the recurrent form for prefill chunks too (each program walks its chunk token by token); the chunked
form of ``reference.gated_delta`` (a block's tokens as matrix products) is not written in Triton yet, so long
prefills are slower here than they could be. Tested under the interpreter (``TRITON_INTERPRET=1``) against the
reference; not yet run on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gated_delta_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, pool_ptr, slots_ptr, cu_ptr, fresh_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_ot, stride_oh,
    stride_ps, stride_ph, stride_pk, key_dim, value_dim, q_scale,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    v0 = tl.program_id(2) * BLOCK_V
    start = tl.load(cu_ptr + seq)
    end = tl.load(cu_ptr + seq + 1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    vv = v0 + tl.arange(0, BLOCK_V)
    k_mask = kk < key_dim
    v_mask = vv < value_dim
    state_ptrs = pool_ptr + slot * stride_ps + head * stride_ph + kk[:, None] * stride_pk + vv[None, :]
    state_mask = k_mask[:, None] & v_mask[None, :]
    state = tl.load(state_ptrs, mask=state_mask, other=0.0)                       # [BLOCK_K, BLOCK_V] float32
    if tl.load(fresh_ptr + seq) != 0:
        state = tl.zeros([BLOCK_K, BLOCK_V], tl.float32)
    first = start.to(tl.int64)
    for i in range(0, end - start):
        t64 = first + i
        q = tl.load(q_ptr + t64 * stride_qt + head * stride_qh + kk, mask=k_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t64 * stride_kt + head * stride_kh + kk, mask=k_mask, other=0.0).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) * q_scale
        k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
        v = tl.load(v_ptr + t64 * stride_vt + head * stride_vh + vv, mask=v_mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t64 * stride_gt + head)
        beta = tl.load(beta_ptr + t64 * stride_gt + head)
        state = state * tl.exp(g)
        known = tl.sum(k[:, None] * state, 0)                                     # k^T S  [BLOCK_V]
        delta = (v - known) * beta
        state = state + k[:, None] * delta[None, :]
        o = tl.sum(q[:, None] * state, 0)                                         # q^T S  [BLOCK_V]
        tl.store(out_ptr + t64 * stride_ot + head * stride_oh + vv, o, mask=v_mask)
    tl.store(state_ptrs, state, mask=state_mask)


def gated_delta_varlen_triton(q, k, v, g, beta, pool, slots, cu_seqlens, fresh) -> torch.Tensor:
    """q, k [T, H, Dk]; v [T, H, Dv]; g, beta [T, H] float32; pool [slots, H, Dk, Dv] float32 (updated in place);
    slots [S] int64; cu_seqlens [S + 1] int32; fresh [S] bool -> out [T, H, Dv] float32 (arguments checked by
    ``kernels.gated_delta``)."""
    tokens, heads, key_dim = q.shape
    value_dim = v.shape[2]
    out = torch.empty((tokens, heads, value_dim), dtype=torch.float32, device=q.device)
    num_seqs = slots.shape[0]
    if tokens == 0 or num_seqs == 0:
        return out
    block_v = min(32, triton.next_power_of_2(value_dim))
    grid = (num_seqs, heads, triton.cdiv(value_dim, block_v))
    _gated_delta_kernel[grid](
        q, k, v, g, beta, out, pool, slots, cu_seqlens, fresh.to(torch.int8),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), out.stride(0),
        out.stride(1),
        pool.stride(0), pool.stride(1), pool.stride(2), key_dim, value_dim, key_dim ** -0.5,
        BLOCK_K=triton.next_power_of_2(key_dim), BLOCK_V=block_v,
    )
    return out
