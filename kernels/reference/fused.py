"""Torch references for the model's small fused ops: the CPU path of the layers *and* the oracle of the
Triton kernels (``norm_triton``, ``rotary_triton``, ``activation_triton``).

These are the layers' formulas op for op (``workers/layers/norm.py``, ``rotary.py``, ``activation.py``
before the kernels existed), i.e. transformers' own. On CPU the layers now run ``cpu_fused.c`` for
RMSNorm and rotary where it takes the layout (the same arithmetic, but for the order of the norm's sum
of squares) and these references elsewhere. No argument validation here (``fused_ops`` does it).

Rounding, which the Triton kernels reproduce op for op: every torch op on a float16/bfloat16 tensor
rounds its result to that dtype; the kernels compute each such op in float32 and round the result,
which gives the same value (float32's 24-bit significand has at least 2p + 2 bits for float16, p = 11,
and bfloat16, p = 8, so rounding twice equals rounding once for +, -, *). Only float32 internals differ
in the kernels: summation order, and ``rsqrt``, ``cos``, ``sin``, ``exp`` from another math library.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x [..., size], weight [size]: normalise in float32, round to x.dtype, then scale (rounded again)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm_reference(x, weight, eps, residual=None, out=None):
    """x [..., size] -> normed; with ``residual``: s = x + residual (in x.dtype) -> (norm(s), s).

    ``out`` (optional, x's shape) receives the normed rows and is returned instead of a new tensor;
    it may be ``x`` itself. The new residual is always a new tensor.
    """
    if residual is None:
        normed, new_residual = _rms_norm(x, weight, eps), None
    else:
        new_residual = x + residual
        normed = _rms_norm(new_residual, weight, eps)
    if out is not None:
        normed = out.copy_(normed)
    return normed if residual is None else (normed, new_residual)


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                   dtype: torch.dtype, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    # positions [tokens], inv_freq [head_dim / 2] float32 -> cos, signed_sin [tokens, 1, head_dim] (dtype);
    # signed_sin = (-sin, sin) over the two halves, the sign rotate-half puts on x's second half; ``scale``
    # (LongRoPE's attention factor, as transformers applies it) multiplies both in float32 (1.0: exact no-op)
    angles = (positions.float().unsqueeze(-1) * inv_freq).unsqueeze(1)         # [tokens, 1, head_dim / 2]
    cos, sin = (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x [tokens, heads, head_dim] -> same shape (new tensor). rotate_half(x) * sin == roll(x, half) * signed_sin
    # exactly (only signs move), so this is bit-identical to the rotate-half formula with one copy less.
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def rotary_embedding_reference_(q, k, positions, inv_freq, scale: float = 1.0) -> None:
    """Rotate q [tokens, Hq, D] and k [tokens, Hk, D] in place (views of one tensor are fine)."""
    cos, signed_sin = rotary_cos_sin(positions, inv_freq, q.dtype, scale)
    q.copy_(apply_rotary_reference(q, cos, signed_sin))
    k.copy_(apply_rotary_reference(k, cos, signed_sin))


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up [tokens, 2 * inter] (gate first, then up) -> [tokens, inter]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


MOE_ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class ClampedSwiglu:
    """gpt-oss's expert activation on (gate, up): ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with
    ``g = clamp(gate, max=limit)``."""

    limit: float
    alpha: float = 1.702

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        return (up.clamp(-self.limit, self.limit) + 1) * (gate * torch.sigmoid(gate * self.alpha))


def gate_activation(name: str):
    """The experts' gate activation by name: ``silu`` (most MoE models) or ``gelu_tanh`` (Gemma 4's
    ``gelu_pytorch_tanh``)."""
    return F.silu if name == "silu" else lambda gate: F.gelu(gate, approximate="tanh")


def expert_glu(activation):
    """(gate, up) -> the experts' hidden rows: ``act(gate) * up`` for a named ``activation`` (MOE_ACTIVATIONS), or
    the ``ClampedSwiglu`` itself."""
    if isinstance(activation, ClampedSwiglu):
        return activation
    act = gate_activation(activation)
    return lambda gate, up: act(gate) * up


def fused_moe_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, activation="silu", gate_up_bias: torch.Tensor | None = None,
                        down_bias: torch.Tensor | None = None) -> torch.Tensor:
    # x [T, H]; gate_up [E, 2I, H] (gate rows first); down [E, H, I]; topk_weights [T, k] (x's dtype);
    # topk_ids [T, k]; optional biases gate_up_bias [E, 2I] (gate half first), down_bias [E, H] -> [T, H]: per
    # picked expert, in ascending expert order (transformers' loop), weight * (down(glu(gate, up)) + down_bias)
    # added into the token's row (glu: ``expert_glu(activation)``)
    glu = expert_glu(activation)
    out = torch.zeros_like(x)
    for e in torch.unique(topk_ids).tolist():
        slot, token = torch.where((topk_ids == e).T)                                 # [k, T] order
        gate, up = F.linear(x[token], gate_up[e], None if gate_up_bias is None else gate_up_bias[e]).chunk(2, dim=-1)
        y = F.linear(glu(gate, up), down[e], None if down_bias is None else down_bias[e]) \
            * topk_weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out
