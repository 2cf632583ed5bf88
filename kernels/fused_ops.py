"""Public entry points of the model's small fused ops: validate, then dispatch to Triton (CUDA) or the
torch reference (CPU, bit-identical to the layers' original code; see ``reference.fused``).

* ``rms_norm(x, weight, eps, residual=None, *, out=None)``: RMSNorm over the last dim of
  ``[tokens, size]`` or ``[tokens, heads, size]`` (any token/head strides: a head slice of qkv works),
  with the optional residual add: returns ``normed`` or ``(normed, x + residual)``.
* ``rotary_embedding_(q, k, positions, inv_freq)``: rotate-half rope, in place on q and k.
* ``silu_and_mul(gate_up)``: ``silu(gate) * up`` of ``[tokens, 2 * inter]`` -> ``[tokens, inter]``.
* ``apply_rotary(x, cos, signed_sin)``: the CPU rotary path, a rotated copy of ``[tokens, heads, D]``
  from one step's ``rotary_cos_sin`` tables (CUDA rotates in place with ``rotary_embedding_``).

``use_triton`` works as in ``api``: ``None`` = Triton for CUDA tensors, the CPU path for CPU tensors;
``True`` on CPU tensors needs ``TRITON_INTERPRET=1``. The CPU path of ``rms_norm`` and ``apply_rotary``
is ``cpu_fused.c`` (one C call, op for op the reference's arithmetic) for float32/bfloat16 in the
layouts it takes, else the torch reference; ``silu_and_mul`` too (its exp is not torch's: a float32
result may differ from the reference by an ulp or two). The checks read
metadata only (ranks, shapes, dtypes, devices, strides, eps), never tensor contents, so the CUDA path
never syncs with the host and can be captured in a CUDA graph. Every check raises ``ValueError``
starting with the argument's name.
"""

from __future__ import annotations

import math

import torch

from . import validation as v
from .api import _triton_wanted
from .cpu import cpu_fused, cpu_twins
from .quant_gemm import PackedExperts, check_packed_experts
from .reference.fused import (
    MOE_ACTIVATIONS,
    ClampedSwiglu,
    apply_rotary_reference,
    expert_glu,
    fused_moe_reference,
    rms_norm_reference,
    rotary_embedding_reference_,
    silu_and_mul_reference,
)
from .triton.activation_triton import silu_and_mul_triton
from .triton.moe_triton import fused_moe_triton
from .triton.norm_triton import MAX_SIZE, rms_norm_triton
from .triton.rotary_triton import rotary_embedding_triton


def fused_triton_path(device: torch.device) -> bool:
    """Whether the entry points here run their Triton kernels by default for tensors on ``device``
    (for callers that lay out their data differently for the two paths, like the decoder)."""
    return _triton_wanted(None, device)


def _check_rows(name: str, t, ranks: tuple[int, ...], device=None) -> None:
    """A float tensor of one of ``ranks`` with its last dim contiguous."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() not in ranks:
        raise ValueError(f"{name}: expected rank {' or '.join(map(str, ranks))}, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if t.dtype not in v.SUPPORTED_DTYPES:
        raise ValueError(f"{name}: unsupported dtype {t.dtype}; expected one of {v.SUPPORTED_DTYPES}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dim must be contiguous (stride(-1) == 1)")


def _check_like(name: str, t, ref: torch.Tensor, ref_name: str) -> None:
    """Same rank, shape, dtype and device as ``ref``, last dim contiguous."""
    _check_rows(name, t, (ref.dim(),), ref.device)
    if t.shape != ref.shape or t.dtype != ref.dtype:
        raise ValueError(f"{name}: expected shape {tuple(ref.shape)} and dtype {ref.dtype} like {ref_name}, "
                         f"got {tuple(t.shape)} {t.dtype}")


def _check_vector(name: str, t, length: int, dtype: torch.dtype, device) -> None:
    v.check_tensor(name, t, 1, device)
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if t.shape[0] != length:
        raise ValueError(f"{name}: expected shape [{length}], got {tuple(t.shape)}")
    if length > 1 and t.stride(0) != 1:
        raise ValueError(f"{name}: must be contiguous (stride(0) == 1)")


def _check_eps(eps) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps: expected a positive finite float, got {eps!r}")


def rms_norm(x, weight, eps, residual=None, *, out=None, use_triton=None):
    """x [tokens, size] or [tokens, heads, size] -> norm(x), or with ``residual`` (x's shape)
    -> (norm(x + residual), x + residual).

    ``weight`` [size] in x's dtype. ``out`` (optional, x's shape and dtype) receives the normed rows and
    is returned; it may be ``x`` itself (in place) but must not partly overlap x or residual. Other
    outputs are new contiguous tensors; x and residual are never modified (unless ``out is x``).
    """
    _check_rows("x", x, (2, 3))
    if x.shape[-1] == 0:
        raise ValueError(f"x: empty last dim in shape {tuple(x.shape)}")
    _check_vector("weight", weight, x.shape[-1], x.dtype, x.device)
    _check_eps(eps)
    if residual is not None:
        _check_like("residual", residual, x, "x")
    if out is not None:
        _check_like("out", out, x, "x")
    if not _triton_wanted(use_triton, x.device):
        if cpu_fused.supports_rms_norm(x, residual, out) and cpu_twins.prefer_c("rms_norm", x):
            return cpu_fused.rms_norm_cpu(x, weight, eps, residual, out)
        return rms_norm_reference(x, weight, eps, residual, out)
    if x.shape[-1] > MAX_SIZE:
        raise ValueError(f"x: last dim {x.shape[-1]} exceeds the Triton kernel's {MAX_SIZE}")
    normed = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    new_residual = None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rms_norm_triton(x, weight, float(eps), residual, normed, new_residual)
    return normed if residual is None else (normed, new_residual)


def rotary_embedding_(q, k, positions, inv_freq, *, scale: float = 1.0, use_triton=None) -> None:
    """Rotate q [tokens, Hq, D] and k [tokens, Hk, D] in place (rotate-half layout, D even).

    q and k share dtype, D and tokens; they may be head slices of one tensor but must not overlap.
    positions [tokens] int32/int64; inv_freq [D / 2] float32 (angle = float32(position) * inv_freq);
    ``scale`` (positive, finite) multiplies cos and sin (LongRoPE's attention factor).
    """
    _check_rows("q", q, (3,))
    _check_rows("k", k, (3,), q.device)
    if k.dtype != q.dtype:
        raise ValueError(f"k: dtype {k.dtype} differs from q {q.dtype}")
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"k: shape {tuple(k.shape)}, expected [{q.shape[0]}, heads, {q.shape[2]}] "
                         f"(q's tokens and head_dim)")
    head_dim = q.shape[2]
    if head_dim == 0 or head_dim % 2 != 0:
        raise ValueError(f"q: head_dim {head_dim} must be even and positive")
    v.check_tensor("positions", positions, 1, q.device)
    if positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions: expected dtype torch.int32 or torch.int64, got {positions.dtype}")
    if positions.shape[0] != q.shape[0]:
        raise ValueError(f"positions: shape {tuple(positions.shape)}, expected [{q.shape[0]}] (q's tokens)")
    _check_vector("inv_freq", inv_freq, head_dim // 2, torch.float32, q.device)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a positive finite float, got {scale!r}")
    run = rotary_embedding_triton if _triton_wanted(use_triton, q.device) else rotary_embedding_reference_
    run(q, k, positions, inv_freq, scale)


def silu_and_mul(gate_up, *, use_triton=None):
    """gate_up [tokens, 2 * inter] (gate first, then up) -> silu(gate) * up [tokens, inter] (new tensor)."""
    _check_rows("gate_up", gate_up, (2,))
    if gate_up.shape[1] % 2 != 0:
        raise ValueError(f"gate_up: last dim {gate_up.shape[1]} must be even (gate and up halves)")
    if not _triton_wanted(use_triton, gate_up.device):
        if cpu_fused.supports_silu_and_mul(gate_up) and cpu_twins.prefer_c("silu_mul", gate_up):
            return cpu_fused.silu_and_mul_cpu(gate_up)
        return silu_and_mul_reference(gate_up)
    out = torch.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype, device=gate_up.device)
    silu_and_mul_triton(gate_up, out)
    return out


def apply_rotary(x, cos, signed_sin):
    """x [tokens, heads, D] -> x * cos + rotate_half(x) * sin as a new [tokens, heads, D] tensor; cos and
    signed_sin [tokens, 1, D] in x's dtype (``rotary_cos_sin``). CPU: ``cpu_fused.c`` where it takes the
    layout, else the torch reference (also on CUDA tensors)."""
    _check_rows("x", x, (3,))
    for name, table in (("cos", cos), ("signed_sin", signed_sin)):
        _check_rows(name, table, (3,), x.device)
        if tuple(table.shape) != (x.shape[0], 1, x.shape[2]) or table.dtype != x.dtype:
            raise ValueError(f"{name}: expected shape [{x.shape[0]}, 1, {x.shape[2]}] and dtype {x.dtype}, got "
                             f"{tuple(table.shape)} {table.dtype}")
    if cpu_fused.supports_rotary(x, cos) and cpu_twins.prefer_c("rotary", x):
        return cpu_fused.apply_rotary_cpu(x, cos, signed_sin)
    return apply_rotary_reference(x, cos, signed_sin)


def fused_moe(x, gate_up, down, topk_weights, topk_ids, *, activation="silu", gate_up_bias=None, down_bias=None,
              use_triton=None):
    """Mixture-of-experts MLP over the picked experts: x [T, H]; gate_up [E, 2I, H] (gate rows, then up);
    down [E, H, I] (or both ``quant_gemm.PackedExperts``: packed experts); topk_weights [T, k] in x's dtype;
    topk_ids [T, k] int32/int64 in [0, E); optional biases in x's dtype: gate_up_bias [E, 2I] (gate half first),
    down_bias [E, H] -> [T, H] = sum over the picks of weight * (down(glu(gate, up)) + down_bias). ``activation``:
    ``silu`` or ``gelu_tanh`` (Gemma 4) for ``act(gate) * up``, or a ``ClampedSwiglu`` (gpt-oss). Triton on CUDA
    (``moe_triton``: grouped GEMMs over the rows sorted by expert), the torch loop over experts elsewhere
    (``fused_moe_reference``; packed experts dequantized first)."""
    if not (isinstance(activation, ClampedSwiglu) or activation in MOE_ACTIVATIONS):
        raise ValueError(f"activation: expected one of {MOE_ACTIVATIONS} or a ClampedSwiglu, got {activation!r}")
    _check_rows("x", x, (2,))
    packed = isinstance(gate_up, PackedExperts)
    for name, w in (("gate_up", gate_up), ("down", down)):
        if packed:
            check_packed_experts(name, w, x.device)
            continue
        _check_rows(name, w, (3,), x.device)
        if w.dtype != x.dtype:
            raise ValueError(f"{name}: dtype {w.dtype} differs from x {x.dtype}")
    experts, two_inter, hidden = gate_up.shape
    if hidden != x.shape[1] or two_inter % 2 or tuple(down.shape) != (experts, hidden, two_inter // 2):
        raise ValueError(f"gate_up / down: shapes {tuple(gate_up.shape)} / {tuple(down.shape)} do not fit x "
                         f"{tuple(x.shape)} (expected [E, 2I, {x.shape[1]}] and [E, {x.shape[1]}, I])")
    for name, bias, width in (("gate_up_bias", gate_up_bias, two_inter), ("down_bias", down_bias, hidden)):
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (experts, width)
                                 or bias.dtype != x.dtype or bias.device != x.device or not bias.is_contiguous()):
            raise ValueError(f"{name}: expected a contiguous {x.dtype} [{experts}, {width}] on {x.device}, got "
                             f"{getattr(bias, 'dtype', type(bias).__name__)} {list(getattr(bias, 'shape', []))}")
    v.check_tensor("topk_ids", topk_ids, 2, x.device)
    if topk_ids.dtype not in (torch.int32, torch.int64) or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids: expected int32/int64 [{x.shape[0]}, k], got {topk_ids.dtype} "
                         f"{tuple(topk_ids.shape)}")
    v.check_tensor("topk_weights", topk_weights, 2, x.device)
    if topk_weights.shape != topk_ids.shape or topk_weights.dtype != x.dtype:
        raise ValueError(f"topk_weights: expected {tuple(topk_ids.shape)} in {x.dtype}, got "
                         f"{tuple(topk_weights.shape)} {topk_weights.dtype}")
    if v.values_checked(None, x.device) and topk_ids.numel() and (int(topk_ids.min()) < 0
                                                                  or int(topk_ids.max()) >= experts):
        raise ValueError(f"topk_ids: expert ids must lie in [0, {experts})")   # CPU: CUDA never syncs here
    if _triton_wanted(use_triton, x.device):
        return fused_moe_triton(x, gate_up, down, topk_weights, topk_ids, expert_glu(activation), gate_up_bias,
                                down_bias)
    if packed:                                   # the reference: the same values, dequantized
        gate_up, down = gate_up.dequantized(x.dtype), down.dequantized(x.dtype)
    return fused_moe_reference(x, gate_up, down, topk_weights, topk_ids, activation, gate_up_bias, down_bias)

