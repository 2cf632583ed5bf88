"""The gated delta rule's entry points (Gated DeltaNet layers: workers/layers/gated_delta_net.py), checked
before dispatch (ValueError naming the argument):

- ``gated_delta_prefill`` (the tokens of one sequence, the chunked form) and ``gated_delta_decode`` (one token
  of each of B sequences, the one-step recurrence): ``reference.gated_delta`` in float32, the CPU path;
- ``gated_delta_varlen``: a whole step's sequences at once, each from its slot of a state pool, in place:
  a Triton kernel on CUDA (``triton/gated_delta_triton.py``: the chunked form for a step that prefills,
  ``chunked=True``; the recurrent form for a decode-only step, which stays free of host reads for CUDA
  graphs), the references per sequence elsewhere (the oracle the kernels are tested against).

Shapes: q, k [T or B, H, Dk] and v [.., H, Dv] of one dtype (float32, bfloat16 or float16; k and q already
repeated to the H value heads); g (log decay, <= 0) and beta [.., H] float32; states float32 and written in
place: [H, Dk, Dv] for a prefill, [B, H, Dk, Dv] for a decode.
"""

from __future__ import annotations

import torch

from .api import _triton_wanted
from .reference.gated_delta import chunked_reference, decode_step
from .triton.gated_delta_triton import gated_delta_varlen_triton

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


def gated_delta_varlen(q, k, v, g, beta, pool: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
                       fresh: torch.Tensor, *, use_triton: bool | None = None, chunked: bool = False) -> torch.Tensor:
    """A step's sequences: sequence i's tokens are ``[cu_seqlens[i], cu_seqlens[i + 1])`` of q, k [T, H, Dk],
    v [T, H, Dv], g, beta [T, H]; its state is ``pool[slots[i]]`` ([slots, H, Dk, Dv] float32, contiguous,
    updated in place), from zeros when ``fresh[i]`` -> out [T, H, Dv] float32. Slots of one step are distinct
    (but for padding rows of no tokens). Triton on CUDA (``use_triton`` forces it, under the interpreter on CPU):
    its chunked kernel when ``chunked`` (a step with prompt tokens), its recurrent one otherwise (decodes). The
    torch path runs each sequence through ``chunked_reference`` either way."""
    if not isinstance(pool, torch.Tensor) or pool.dim() != 4 or not pool.is_contiguous():
        raise ValueError(f"pool: expected a contiguous 4-d float32 tensor, got {getattr(pool, 'shape', pool)!r}")
    _check(q, k, v, g, beta, pool[0], 3)
    num_seqs = slots.shape[0] if isinstance(slots, torch.Tensor) else -1
    for name, x, dtypes, length in (("slots", slots, (torch.int64,), num_seqs),
                                    ("cu_seqlens", cu_seqlens, (torch.int32,), num_seqs + 1),
                                    ("fresh", fresh, (torch.bool,), num_seqs)):
        if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.dtype not in dtypes or x.shape[0] != length \
                or x.device != q.device:
            raise ValueError(f"{name}: expected {dtypes[0]} [{length}] on {q.device}, got "
                             f"{getattr(x, 'dtype', None)} {list(getattr(x, 'shape', []))}")
    if not (g.is_contiguous() and beta.is_contiguous()):
        raise ValueError("g / beta: expected contiguous [T, H] tensors")
    if _triton_wanted(use_triton, q.device):
        return gated_delta_varlen_triton(q, k, v, g, beta, pool, slots, cu_seqlens, fresh, chunked)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    bounds = cu_seqlens.tolist()
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        if end > start:
            state = pool[int(slots[i])]
            if bool(fresh[i]):
                state.zero_()
            out[start:end] = chunked_reference(q[start:end], k[start:end], v[start:end], g[start:end],
                                               beta[start:end], state, CHUNK_SIZE)
    return out


def gated_delta_spans(q, k, v, g, beta, pool: torch.Tensor, spans: list[tuple], *,
                      use_triton: bool | None = None) -> torch.Tensor:
    """``gated_delta_varlen`` for a step whose sequences are given on the host as ``spans``: per sequence
    ``(start, end, slot, fresh, cuts)``, its tokens ``[start, end)`` run from ``pool[slot]`` (from zeros when
    ``fresh``), and for each ``(offset, target)`` of ``cuts`` (offsets ascending, ``0 < offset <= end - start``)
    ``pool[target]`` takes the state after its first ``offset`` tokens of the step (a hybrid model's prefix-cache
    snapshot) -> out [T, H, Dv] float32. Runs in phases: phase j runs every sequence's j-th piece between its cuts
    in one ``gated_delta_varlen`` call, then copies the states the cuts ending those pieces want."""
    for start, end, _, _, cuts in spans:
        offsets = [offset for offset, _ in cuts]
        if offsets != sorted(set(offsets)) or (offsets and not 0 < offsets[0] <= offsets[-1] <= end - start):
            raise ValueError(f"spans: cuts {cuts} of the sequence at [{start}, {end}) are not ascending offsets in "
                             f"(0, {end - start}]")
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    pieces = []                  # per sequence: [(first token, end token, snapshot slot after it or None), ...]
    for start, end, _, _, cuts in spans:
        bounds = [start] + [start + offset for offset, _ in cuts] + [end]
        pieces.append([(a, b, cuts[j][1] if j < len(cuts) else None)
                       for j, (a, b) in enumerate(zip(bounds, bounds[1:]))])
    device = q.device
    for phase in range(max((len(p) for p in pieces), default=0)):
        rows = [(span, p[phase]) for span, p in zip(spans, pieces) if phase < len(p) and p[phase][1] > p[phase][0]]
        if rows:
            index = torch.cat([torch.arange(a, b, device=device) for _, (a, b, _) in rows])        # [tokens]
            lengths = torch.tensor([0] + [b - a for _, (a, b, _) in rows], device=device)
            cu = lengths.cumsum(0).to(torch.int32)
            slots = torch.tensor([span[2] for span, _ in rows], dtype=torch.int64, device=device)
            fresh = torch.tensor([span[3] and phase == 0 for span, _ in rows], dtype=torch.bool, device=device)
            out[index] = gated_delta_varlen(q[index], k[index], v[index], g[index].contiguous(),
                                            beta[index].contiguous(), pool, slots, cu, fresh, use_triton=use_triton,
                                            chunked=True)
        for span, p in zip(spans, pieces):
            if phase < len(p) and p[phase][2] is not None:
                pool[p[phase][2]].copy_(pool[span[2]])
    return out
