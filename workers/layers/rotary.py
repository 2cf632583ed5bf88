"""Rotary position embedding (rotate-half / NeoX layout, as used by Llama, Qwen2 and Qwen3).

Supported ``rope_type``: ``default``, ``linear`` (positions divided by ``factor``) and ``llama3``
(Llama 3.1+ frequency-dependent scaling). Others raise ValueError naming the rope type.

cos/sin are computed per step from the positions of the scheduled tokens (``RotaryEmbedding.cos_sin``,
once per forward, shared by all layers) instead of a ``max_position_embeddings``-long cache, which
would be large for 128k-context models. The angle of position p and pair i is
``float32(p) * inv_freq[i]``: a single rounded product, the same value any implementation gets.
``cos_sin`` returns the sine with the sign of rotate-half folded in, so ``apply_rotary`` is one roll,
two products and a sum (bit-identical to ``x * cos + rotate_half(x) * sin``); the decoder rotates q
and k of a layer in one call, as one tensor.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config) -> dict:
    """Rope settings from a transformers config (v5 ``rope_parameters`` or v4 ``rope_scaling``)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    for key, value in legacy.items():
        params.setdefault(key, value)
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


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
    def __init__(self, head_dim: int, params: dict, device: torch.device) -> None:
        rope_type = params["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"model: rope_type {rope_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (params["rope_theta"] ** exponents)               # [head_dim / 2]
        if rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        self.inv_freq = inv_freq.to(device)
        self.head_dim = head_dim

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [tokens] -> cos, signed_sin [tokens, 1, head_dim] (broadcast over heads);
        # signed_sin = (-sin, sin) over the two halves, the sign rotate-half puts on x's second half
        angles = (positions.float().unsqueeze(-1) * self.inv_freq).unsqueeze(1)    # [tokens, 1, head_dim / 2]
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x [tokens, heads, head_dim] -> same shape. rotate_half(x) * sin == roll(x, half) * signed_sin
    # exactly (only signs move), so this is bit-identical to the rotate-half formula with one copy less.
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
