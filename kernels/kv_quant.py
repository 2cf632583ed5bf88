"""8-bit KV cache: the quantizer every path shares (torch here; Triton and C do the same arithmetic).

Format (``kv_cache_dtype`` ``int8`` or ``fp8_e4m3``): each cached row, one token's one KV head
(``head_dim`` values), is stored as ``head_dim`` 8-bit codes plus one float16 scale in a scale tensor
``[num_blocks, block_size, num_kv_heads]`` beside the cache (``k_scale`` / ``v_scale``). The scale is
computed when the row is stored, from the row itself (dynamic, per token and head):

    scale = clamp(float16(max |x| / QMAX), 2^-24, 65504)     # QMAX: 127 (int8), 448 (fp8 e4m3)
    int8:  code = clamp(floor(x / scale + 0.5), -127, 127)
    fp8:   code = float8_e4m3fn(clamp(x / scale, -448, 448))  # round to nearest even
    value = float32(code) * float32(scale)

in float32 from the row's compute dtype. Why per row and not per tensor (vLLM's calculated scales):
a row never saturates, nothing is calibrated, and a copied or prefix-shared block carries its scales
with it (copy-on-write copies the scale tensor's block too). The cost is 2 bytes per row: a row of 64
(128) values takes 66 (130) bytes against 128 (256) in bfloat16, 1.94x (1.97x) the rows per byte.

Checkpoint scales (``static_scale``): a checkpoint calibrated for an FP8 KV cache carries one scale per
layer for K and one for V (``self_attn.k_scale`` / ``v_scale``, as llm-compressor writes them and vLLM
reads them). With ``fp8_e4m3`` the rows of such a layer are stored with that scale instead of their own
(``code = float8_e4m3fn(clamp(x / s, -448, 448))``, values beyond 448 s saturate), so the model computes
with the numbers it was calibrated with; the scale, rounded to float16, is still written per row, so every
reader of the cache is unchanged. An int8 cache ignores them (they are calibrated for e4m3's range).
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
QUANTIZED = tuple(KV_CACHE_DTYPES.values())
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_DTYPE = torch.float16
SCALE_MIN = 2.0 ** -24          # the smallest positive float16: an all-zero row still has a scale
SCALE_MAX = 65504.0             # the largest float16


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANTIZED


def cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """``kv_cache_dtype`` -> the cache tensor's dtype: ``auto`` is the model's."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: expected 'auto' or one of {sorted(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name]


def static_scale(value: float) -> float:
    """A checkpoint's KV scale as the cache stores it: rounded to float16, within [SCALE_MIN, SCALE_MAX]."""
    return float(torch.tensor(value, dtype=SCALE_DTYPE).clamp_(SCALE_MIN, SCALE_MAX))


def quantize_rows(x: torch.Tensor, dtype: torch.dtype, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] (any float dtype) -> (codes [..., head_dim] of ``dtype``, scales [...] float16).
    ``scale``: a checkpoint's scale (``static_scale``'s value) for every row instead of each row's own."""
    xf = x.to(torch.float32)
    if scale is not None:
        scale = torch.full(xf.shape[:-1], scale, dtype=SCALE_DTYPE, device=x.device)
    else:
        scale = (xf.abs().amax(dim=-1) / QMAX[dtype]).to(SCALE_DTYPE).clamp_(SCALE_MIN, SCALE_MAX)
    y = xf / scale.to(torch.float32).unsqueeze(-1)
    if dtype == torch.int8:
        return torch.floor(y + 0.5).clamp_(-127.0, 127.0).to(torch.int8), scale
    return y.clamp_(-448.0, 448.0).to(dtype), scale


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [..., head_dim], scales [...] -> float32 [..., head_dim]."""
    return codes.to(torch.float32) * scales.to(torch.float32).unsqueeze(-1)
