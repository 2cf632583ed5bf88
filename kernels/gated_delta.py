"""The gated delta rule's entry points (Gated DeltaNet layers: workers/layers/gated_delta_net.py), checked
before dispatch (ValueError naming the argument), then computed by ``reference.gated_delta`` in float32 on
every device: ``gated_delta_prefill`` (the tokens of one sequence, the chunked form) and ``gated_delta_decode``
(one token of each of B sequences, the one-step recurrence). A Triton kernel for CUDA is not written yet; the
torch code runs there as it is (no host syncs, so it can be captured).

Shapes: q, k [T or B, H, Dk] and v [.., H, Dv] of one dtype (float32, bfloat16 or float16; k and q already
repeated to the H value heads); g (log decay, <= 0) and beta [.., H] float32; states float32 and written in
place: [H, Dk, Dv] for a prefill, [B, H, Dk, Dv] for a decode.
"""

from __future__ import annotations

import torch

from .reference.gated_delta import chunked_reference, decode_step

CHUNK_SIZE = 64
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _check(q, k, v, g, beta, state, state_rank: int) -> None:
    lead = q.shape[:-1]                                   # (T, H) or (B, H)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name}: expected a 3-d tensor [tokens, heads, head_dim], got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
        if x.dtype not in _FLOATS or x.dtype != q.dtype or x.device != q.device:
            raise ValueError(f"{name}: expected {q.dtype} on {q.device} (q's), got {x.dtype} on {x.device}")
    if k.shape != q.shape or v.shape[:-1] != lead:
        raise ValueError(f"k / v: shapes {tuple(k.shape)} / {tuple(v.shape)} do not fit q {tuple(q.shape)}")
    for name, x in (("g", g), ("beta", beta)):
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(lead) or x.dtype != torch.float32 \
                or x.device != q.device:
            raise ValueError(f"{name}: expected float32 {list(lead)} on {q.device}, got "
                             f"{getattr(x, 'dtype', None)} {list(getattr(x, 'shape', []))}")
    want = ((lead[0],) if state_rank == 4 else ()) + (q.shape[1], q.shape[2], v.shape[2])
    if not isinstance(state, torch.Tensor) or tuple(state.shape) != want or state.dtype != torch.float32 \
            or state.device != q.device:
        raise ValueError(f"state: expected float32 {list(want)} on {q.device}, got {getattr(state, 'dtype', None)} "
                         f"{list(getattr(state, 'shape', []))}")


def gated_delta_prefill(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """T tokens of one sequence from ``state`` [H, Dk, Dv] (updated in place) -> out [T, H, Dv] float32."""
    _check(q, k, v, g, beta, state, 3)
    return chunked_reference(q, k, v, g, beta, state, CHUNK_SIZE)


def gated_delta_decode(q, k, v, g, beta, states: torch.Tensor) -> torch.Tensor:
    """One token of each of B sequences, ``states`` [B, H, Dk, Dv] (updated in place) -> out [B, H, Dv] float32."""
    _check(q, k, v, g, beta, states, 4)
    return decode_step(q, k, v, g, beta, states)
