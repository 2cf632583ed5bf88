"""The gated delta rule (Gated DeltaNet, the linear-attention layers of Qwen3.5 / 3.6) in torch, float32.

Per value head, with a state ``S`` [Dk, Dv] carried across the sequence, for each token t (q_t and k_t
L2-normalised, q_t also scaled by Dk^-0.5; ``g_t <= 0`` a log decay, ``beta_t`` in (0, 1)):

    S   = exp(g_t) * S                        decay
    d_t = beta_t * (v_t - S^T k_t)            the part of v_t the state does not predict yet
    S   = S + k_t d_t^T                       delta-rule write
    o_t = S^T q_t                             read

``recurrent_reference`` runs that loop token by token (the oracle, and the one-step decode for a batch of
sequences). ``chunked_reference`` computes the same in blocks of ``chunk_size`` tokens: with
``G_i = g_1 + ... + g_i`` inside a block and ``S_0`` the state before it, unrolling the loop gives

    d_i + sum_{j<i} beta_i exp(G_i - G_j) (k_i . k_j) d_j = beta_i (v_i - exp(G_i) S_0^T k_i)
    o_i = exp(G_i) S_0^T q_i + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) d_j
    S_C = exp(G_C) S_0 + sum_j exp(G_C - G_j) k_j d_j^T

so the d's of a block are one unit lower-triangular solve, and the block's outputs and final state are
matrix products: the form a prefill uses (many tokens), exact up to float rounding against the loop.
Decays are differences of cumulative sums, ``G_i - G_j <= 0`` for ``j <= i``, so no exponent overflows.
"""

from __future__ import annotations

import torch

L2_EPS = 1e-6


def normalized_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., Dk] -> float32 copies L2-normalised (eps 1e-6 under the root), q also scaled by Dk^-0.5."""
    q, k = q.float(), k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    return q * (q.shape[-1] ** -0.5), k


def recurrent_reference(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """q, k [T, H, Dk]; v [T, H, Dv]; g, beta [T, H]; state [H, Dk, Dv] float32, updated in place
    -> out [T, H, Dv] float32, token by token: T tokens of ONE sequence (a batch of one-token sequences is
    ``decode_step``)."""
    q, k = normalized_qk(q, k)
    v, g, beta = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    s = state
    for t in range(q.shape[0]):
        s.mul_(g[t].exp()[:, None, None])
        delta = (v[t] - torch.einsum("hk,hkv->hv", k[t], s)) * beta[t][:, None]            # [H, Dv]
        s.add_(k[t][:, :, None] * delta[:, None, :])
        out[t] = torch.einsum("hk,hkv->hv", q[t], s)
    return out


def decode_step(q, k, v, g, beta, states: torch.Tensor) -> torch.Tensor:
    """One token of each of B sequences: q, k [B, H, Dk]; v [B, H, Dv]; g, beta [B, H]; states [B, H, Dk, Dv]
    float32 (each sequence's own), updated in place -> out [B, H, Dv] float32."""
    q, k = normalized_qk(q, k)
    b, h, dk = k.shape
    dv = v.shape[-1]
    flat = states.view(b * h, dk, dv)                       # the batched products below: 4 passes over the states
    flat.mul_(g.float().exp().reshape(b * h, 1, 1))
    known = torch.bmm(k.reshape(b * h, 1, dk), flat).view(b, h, dv)                             # k^T S
    delta = (v.float() - known) * beta.float()[:, :, None]                                     # [B, H, Dv]
    flat.baddbmm_(k.reshape(b * h, dk, 1), delta.reshape(b * h, 1, dv))                       # S += k d^T
    return torch.bmm(q.reshape(b * h, 1, dk), flat).view(b, h, dv)


def chunked_reference(q, k, v, g, beta, state: torch.Tensor, chunk_size: int = 64) -> torch.Tensor:
    """``recurrent_reference``'s contract, computed block by block (module docstring)."""
    q, k = normalized_qk(q, k)
    v, g, beta = v.float(), g.float(), beta.float()
    tokens, heads, _ = q.shape
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for start in range(0, tokens, chunk_size):
        end = min(start + chunk_size, tokens)
        # per head: [H, C, D] and [H, C]
        qc, kc, vc = (x[start:end].transpose(0, 1) for x in (q, k, v))
        bc = beta[start:end].transpose(0, 1)
        cum = g[start:end].transpose(0, 1).cumsum(-1)                                    # G_i  [H, C]
        n = end - start
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()             # j <= i
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~lower, float("-inf")).exp()   # [H, C, C]
        strict = decay.masked_fill(torch.eye(n, dtype=torch.bool, device=q.device), 0.0)
        system = bc[:, :, None] * strict * (kc @ kc.transpose(1, 2))                  # strictly lower [H, C, C]
        system = system + torch.eye(n, device=q.device)
        rhs = bc[:, :, None] * (vc - cum.exp()[:, :, None] * (kc @ state))             # [H, C, Dv]
        deltas = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        scores = decay * (qc @ kc.transpose(1, 2))                                      # [H, C, C]
        out[start:end] = (cum.exp()[:, :, None] * (qc @ state) + scores @ deltas).transpose(0, 1)
        last = cum[:, -1:]                                                              # G_C [H, 1]
        state.mul_(last.exp()[:, :, None])
        state.add_((kc * (last - cum).exp()[:, :, None]).transpose(1, 2) @ deltas)
    return out
