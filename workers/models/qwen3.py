"""Qwen3 (dense): per-head RMSNorm on q and k before rotary, optional attention bias, explicit head_dim.

Configs that enable the sliding window (``use_sliding_window``) are rejected.
"""

from __future__ import annotations

from .decoder import ArchSpec, DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def arch_spec(hf_config, max_model_len: int) -> ArchSpec:
        if getattr(hf_config, "use_sliding_window", False):
            raise ValueError("model: Qwen3 configs with use_sliding_window=true are not supported")
        bias = bool(getattr(hf_config, "attention_bias", False))
        return ArchSpec(qkv_bias=bias, o_bias=bias, qk_norm=True)
