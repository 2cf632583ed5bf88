"""Triton gated delta rule over a step's sequences, reading and writing their states in the pool in place.

Two kernels, one launch per step each; both take a grid of (sequence, value head, block of ``BLOCK_V`` value
dimensions), load their slot's state columns ``S [Dk, BLOCK_V]`` (float32; zeros for a fresh sequence), walk the
sequence's tokens of the step (``cu_seqlens``), L2-normalise q and k in float32 as the torch reference does, write
each token's output columns and store the state back:

- ``_gated_delta_kernel``, the recurrent form: token by token. A decode step (one token per sequence) uses it: no
  host reads, no gather or scatter of the pool, so a decode can be captured in a CUDA graph.
- ``_gated_delta_chunked_kernel``, the chunked form of ``reference.gated_delta`` for prefill steps: the tokens
  in blocks of ``CHUNK`` as matrix products (``tl.dot`` in IEEE float32). Per block, with ``G`` the cumulative
  log decays: ``A = beta_i exp(G_i - G_j) (k_i . k_j)`` strictly below the diagonal; ``T = (I + A)^-1`` by
  forward substitution (row i of T is ``e_i - A[i, :i] T[:i]``, rows of a unit lower-triangular inverse: no
  division, no pivot); the block's deltas ``D = T (beta (v - exp(G) K S))``; outputs
  ``exp(G) Q S + (exp(G_i - G_j) [j <= i] * Q K^T) D``; state ``exp(G_C) S + (K exp(G_C - G))^T D``. Rows past
  the sequence's end load as zeros with ``g = beta = 0``: their deltas are zero and they change nothing.

Which one runs is the caller's choice (``chunked``): the layer knows on the host whether a step is decode-only.
Both are tested under the interpreter (``TRITON_INTERPRET=1``) against the float64 loop; neither has run on a GPU
yet. The chunked kernel's tile and product precision (``chunked_config``: TF32 tensor cores for 16-bit models,
IEEE float32 products for float32 ones) were chosen from its sm_90 compile (``benchmarks.sm90_report``), not
from timings.
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


def gated_delta_varlen_triton(q, k, v, g, beta, pool, slots, cu_seqlens, fresh, chunked: bool = False
                              ) -> torch.Tensor:
    """q, k [T, H, Dk]; v [T, H, Dv]; g, beta [T, H] float32; pool [slots, H, Dk, Dv] float32 (updated in place);
    slots [S] int64; cu_seqlens [S + 1] int32; fresh [S] bool -> out [T, H, Dv] float32 (arguments checked by
    ``kernels.gated_delta``). ``chunked``: the chunked kernel (prefill steps), else the recurrent one."""
    tokens, heads, key_dim = q.shape
    value_dim = v.shape[2]
    out = torch.empty((tokens, heads, value_dim), dtype=torch.float32, device=q.device)
    num_seqs = slots.shape[0]
    if tokens == 0 or num_seqs == 0:
        return out
    args = (q, k, v, g, beta, out, pool, slots, cu_seqlens, fresh.to(torch.int8),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), out.stride(0),
            out.stride(1), pool.stride(0), pool.stride(1), pool.stride(2), key_dim, value_dim, key_dim ** -0.5)
    if chunked:
        cfg = chunked_config(value_dim, q.dtype)
        grid = (num_seqs, heads, triton.cdiv(value_dim, cfg["BLOCK_V"]))
        _gated_delta_chunked_kernel[grid](*args, CHUNK_T=CHUNK, BLOCK_K=max(16, triton.next_power_of_2(key_dim)), **cfg)
        return out
    block_v = min(32, triton.next_power_of_2(value_dim))
    grid = (num_seqs, heads, triton.cdiv(value_dim, block_v))
    _gated_delta_kernel[grid](*args, BLOCK_K=triton.next_power_of_2(key_dim), BLOCK_V=block_v)
    return out

CHUNK = 32   # tokens per block of the chunked kernel (>= 16 for tl.dot)


def chunked_config(value_dim: int, dtype: torch.dtype) -> dict:
    """The chunked kernel's launch constants. float32 models: IEEE float32 products (the fp32 references'
    tolerance), 32 value dims a program, 4 warps. 16-bit models: TF32 tensor-core products over float32 tiles
    (finer than the bf16 / fp16 inputs), 64 value dims, 8 warps: the sm_90 compile with the fewest instructions
    per token and value dim, 352 B spilled (docs/design/kernels.md). Value blocks stay >= 16 for ``tl.dot``."""
    if dtype == torch.float32:
        return dict(BLOCK_V=min(32, max(16, triton.next_power_of_2(value_dim))), PRECISION="ieee", num_warps=4)
    return dict(BLOCK_V=min(64, max(16, triton.next_power_of_2(value_dim))), PRECISION="tf32", num_warps=8)


@triton.jit
def _gated_delta_chunked_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, pool_ptr, slots_ptr, cu_ptr, fresh_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_ot, stride_oh,
    stride_ps, stride_ph, stride_pk, key_dim, value_dim, q_scale,
    CHUNK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    v0 = tl.program_id(2) * BLOCK_V
    start = tl.load(cu_ptr + seq)
    end = tl.load(cu_ptr + seq + 1)
    if end > start:                                  # a padding row of no tokens touches nothing
        slot = tl.load(slots_ptr + seq).to(tl.int64)
        kk = tl.arange(0, BLOCK_K)
        vv = v0 + tl.arange(0, BLOCK_V)
        rows = tl.arange(0, CHUNK_T)
        k_mask = kk < key_dim
        v_mask = vv < value_dim
        lower = rows[:, None] >= rows[None, :]                                        # j <= i  [C, C]
        strict = rows[:, None] > rows[None, :]
        eye = (rows[:, None] == rows[None, :]).to(tl.float32)
        state_ptrs = pool_ptr + slot * stride_ps + head * stride_ph + kk[:, None] * stride_pk + vv[None, :]
        state_mask = k_mask[:, None] & v_mask[None, :]
        state = tl.load(state_ptrs, mask=state_mask, other=0.0)                       # S [BLOCK_K, BLOCK_V]
        if tl.load(fresh_ptr + seq) != 0:
            state = tl.zeros([BLOCK_K, BLOCK_V], tl.float32)
        for first in range(start, end, CHUNK_T):
            t = (first + rows).to(tl.int64)                                           # [C]
            t_mask = t < end
            qk_mask = t_mask[:, None] & k_mask[None, :]
            q = tl.load(q_ptr + t[:, None] * stride_qt + head * stride_qh + kk[None, :], mask=qk_mask,
                        other=0.0).to(tl.float32)                                     # [C, BLOCK_K]
            k = tl.load(k_ptr + t[:, None] * stride_kt + head * stride_kh + kk[None, :], mask=qk_mask,
                        other=0.0).to(tl.float32)
            q = q / tl.sqrt(tl.sum(q * q, 1) + 1e-6)[:, None] * q_scale
            k = k / tl.sqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
            v = tl.load(v_ptr + t[:, None] * stride_vt + head * stride_vh + vv[None, :],
                        mask=t_mask[:, None] & v_mask[None, :], other=0.0).to(tl.float32)   # [C, BLOCK_V]
            g = tl.load(g_ptr + t * stride_gt + head, mask=t_mask, other=0.0)          # [C]
            beta = tl.load(beta_ptr + t * stride_gt + head, mask=t_mask, other=0.0)
            cum = tl.cumsum(g, 0)                                                     # G_i  [C]
            decay = tl.exp(tl.where(lower, cum[:, None] - cum[None, :], float("-inf")))   # [C, C], 0 above
            kkt = tl.dot(k, tl.trans(k), input_precision=PRECISION)                   # k_i . k_j  [C, C]
            a = tl.where(strict, beta[:, None] * decay * kkt, 0.0)
            inverse = eye                                                             # T = (I + A)^-1
            for i in range(1, CHUNK_T):
                a_row = tl.sum(tl.where(rows[:, None] == i, a, 0.0), 0)                # A[i, :]  [C]
                t_row = tl.where(rows == i, 1.0, 0.0) - tl.sum(a_row[:, None] * inverse, 0)
                inverse = tl.where(rows[:, None] == i, t_row[None, :], inverse)
            known = tl.dot(k, state, input_precision=PRECISION)                       # K S  [C, BLOCK_V]
            rhs = beta[:, None] * (v - tl.exp(cum)[:, None] * known)
            deltas = tl.dot(inverse, rhs, input_precision=PRECISION)                  # D  [C, BLOCK_V]
            scores = tl.where(lower, decay * tl.dot(q, tl.trans(k), input_precision=PRECISION), 0.0)
            o = tl.exp(cum)[:, None] * tl.dot(q, state, input_precision=PRECISION) \
                + tl.dot(scores, deltas, input_precision=PRECISION)
            tl.store(out_ptr + t[:, None] * stride_ot + head * stride_oh + vv[None, :], o,
                     mask=t_mask[:, None] & v_mask[None, :])
            last = tl.sum(g, 0)                                                       # G_C (masked g are 0)
            weighted = k * tl.exp(last - cum)[:, None]                                # [C, BLOCK_K]
            state = state * tl.exp(last) + tl.dot(tl.trans(weighted), deltas, input_precision=PRECISION)
        tl.store(state_ptrs, state, mask=state_mask)
