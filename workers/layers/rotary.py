"""Rotary position embedding (rotate-half / NeoX layout, as used by Llama, Qwen2 and Qwen3).

Supported ``rope_type``: ``default``, ``linear`` (positions divided by ``factor``), ``llama3``
(Llama 3.1+ frequency-dependent scaling), ``longrope`` (also named ``su``: Phi-3's per-frequency
``short_factor`` / ``long_factor`` and an attention factor that scales cos and sin) and ``yarn`` (gpt-oss:
frequencies blended between interpolated and extrapolated by a linear ramp over the dimensions between
``beta_fast`` and ``beta_slow`` rotations, and an attention factor ``0.1 ln(factor) + 1``) and ``proportional``
(Gemma 4's global layers: the default frequencies of the whole head for the first
``int(partial_rotary_factor * head_dim // 2)`` pairs, zero for the rest, so those pairs pass through unrotated;
all divided by ``factor``, default 1). Others raise
ValueError naming the rope type. Every type is an ``inv_freq`` vector (the angle of position p and pair
i is ``float32(p) * inv_freq[i]``, a single rounded product, the same value any implementation gets)
and a ``scale`` for cos and sin (1 but for LongRoPE).

LongRoPE's factors are chosen once, by ``max_model_len``: the long ones when the model may run past
``original_max_position_embeddings``, else the short ones (vLLM's rule). transformers switches per
forward by the longest position in it, so the two agree on every sequence when ``max_model_len`` is at
most the original length; with a longer ``max_model_len`` a short sequence gets the long factors here
(transformers would use the short ones until it grows past the original length).

``RotaryEmbedding.for_step`` prepares one forward's rotary inputs (``RotaryStep``, shared by all layers),
for one of two paths (``kernels.fused_triton_path``: CUDA tensors take the first):

* fused: ``RotaryStep.rotate_`` rotates q and k in place with ``kernels.rotary_embedding_`` (Triton),
  which computes the angles itself from the positions; no per-step cos/sin tensors.
* torch (CPU): cos/sin computed once per step from the positions of the scheduled tokens
  (``kernels.rotary_cos_sin``) instead of a ``max_position_embeddings``-long cache, which would be
  large for 128k-context models. The sine carries the sign of rotate-half, so ``apply_rotary`` is one
  roll, two products and a sum (bit-identical to ``x * cos + rotate_half(x) * sin``); the decoder
  rotates q and k of a layer in one call, as one tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ... import kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn", "proportional")


def rope_parameters(hf_config) -> dict:
    """Rope settings from a transformers config (v5 ``rope_parameters`` or v4 ``rope_scaling``)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    for key, value in legacy.items():
        params.setdefault(key, value)
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] == "su":
        params["rope_type"] = "longrope"
    for key in ("max_position_embeddings", "original_max_position_embeddings"):
        if key not in params and getattr(hf_config, key, None) is not None:
            params[key] = getattr(hf_config, key)
    return params


def _longrope(exponents: torch.Tensor, params: dict, max_model_len: int | None) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention factor) of LongRoPE, transformers' arithmetic (module docstring: which factors)."""
    original = params.get("original_max_position_embeddings")
    if not original:
        raise ValueError("model: rope_type 'longrope' needs original_max_position_embeddings")
    long = max_model_len is not None and max_model_len > original
    factors = params["long_factor" if long else "short_factor"]
    if len(factors) != exponents.shape[0]:
        raise ValueError(f"model: longrope {'long' if long else 'short'}_factor has {len(factors)} entries, "
                         f"expected head_dim / 2 = {exponents.shape[0]}")
    inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * params["rope_theta"] ** exponents)
    factor = params.get("factor") or params.get("max_position_embeddings", original) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq, float(attention)


def _yarn(exponents: torch.Tensor, head_dim: int, params: dict) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention factor) of YaRN, transformers' arithmetic op for op (so the angles are the same
    float32 values)."""
    original = params.get("original_max_position_embeddings")
    factor = params.get("factor")
    if not original or not factor:
        raise ValueError("model: rope_type 'yarn' needs factor and original_max_position_embeddings")
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        scaled = (lambda m: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0)   # noqa: E731
        attention = scaled(mscale) / scaled(mscale_all) if mscale and mscale_all else scaled(1)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1
    base = params["rope_theta"]

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp                                                 # 1: keep the original frequency
    pos_freqs = base ** exponents
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def _proportional(inv_freq: torch.Tensor, head_dim: int, params: dict) -> torch.Tensor:
    """Proportional RoPE: ``inv_freq`` [head_dim / 2] kept for the first ``int(partial_rotary_factor * head_dim
    // 2)`` pairs, zero (no rotation) for the others, then divided by ``factor``."""
    factor = params.get("partial_rotary_factor", 1.0)
    factor = 1.0 if factor is None else factor
    if not 0.0 <= factor <= 1.0:
        raise ValueError(f"model: proportional rope's partial_rotary_factor must be in [0, 1], got {factor!r}")
    rotated = int(factor * head_dim // 2)
    inv_freq = torch.cat([inv_freq[:rotated], torch.zeros(head_dim // 2 - rotated)])
    return inv_freq / params.get("factor", 1.0)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    original = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths (low frequencies) are slowed down by `factor`, short ones are kept,
    # and the band in between interpolates linearly in original / wavelen
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    blend = (original / wavelen - low) / (high - low)
    blended = (1 - blend) * scaled / factor + blend * scaled
    in_band = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(in_band, blended, scaled)


class RotaryEmbedding:
    def __init__(self, head_dim: int, params: dict, device: torch.device, max_model_len: int | None = None) -> None:
        rope_type = params["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"model: rope_type {rope_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (params["rope_theta"] ** exponents)               # [head_dim / 2]
        self.scale = 1.0                                                    # multiplies cos and sin
        if rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif rope_type == "longrope":
            inv_freq, self.scale = _longrope(exponents, params, max_model_len)
        elif rope_type == "yarn":
            inv_freq, self.scale = _yarn(exponents, head_dim, params)
        elif rope_type == "proportional":
            inv_freq = _proportional(inv_freq, head_dim, params)
        self.inv_freq = inv_freq.to(device)
        self.head_dim = head_dim

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [tokens] -> cos, signed_sin [tokens, 1, head_dim] (broadcast over heads);
        # signed_sin = (-sin, sin) over the two halves, the sign rotate-half puts on x's second half
        return kernels.rotary_cos_sin(positions, self.inv_freq, dtype, self.scale)

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryStep:
        """positions [tokens] -> the rotary inputs of one forward (no host sync: the path follows the device)."""
        if kernels.fused_triton_path(positions.device):
            return RotaryStep(positions, self.inv_freq, None, None, self.scale)
        return RotaryStep(positions, self.inv_freq, *self.cos_sin(positions, dtype), self.scale)


@dataclass(frozen=True)
class RotaryStep:
    """One forward's rotary inputs. Fused path: ``cos``/``sin`` are None and ``rotate_`` works in place;
    torch path: ``cos``/``sin`` [tokens, 1, head_dim] for ``apply``."""

    positions: torch.Tensor           # [tokens] int32/int64
    inv_freq: torch.Tensor            # [head_dim / 2] float32
    cos: torch.Tensor | None
    sin: torch.Tensor | None          # signed: (-sin, sin) over the two halves
    scale: float = 1.0                # multiplies cos and sin (LongRoPE's attention factor)

    @property
    def fused(self) -> bool:
        return self.cos is None

    def rotate_(self, q: torch.Tensor, k: torch.Tensor) -> None:
        # q [tokens, Hq, D], k [tokens, Hk, D] (disjoint, e.g. head slices of qkv) rotated in place
        kernels.rotary_embedding_(q, k, self.positions, self.inv_freq, scale=self.scale)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        # torch path: x [tokens, heads, D] -> rotated copy
        return apply_rotary(x, self.cos, self.sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x [tokens, heads, head_dim] -> same shape: x * cos + rotate_half(x) * sin, op for op
    return kernels.apply_rotary(x, cos, signed_sin)
