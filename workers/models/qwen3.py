"""Qwen3 (dense): per-head RMSNorm on q and k before rotary, optional attention bias, explicit head_dim.

With ``use_sliding_window`` the layers that ``layer_types`` marks (from ``max_window_layers`` on) attend
within ``sliding_window`` (``llama.qwen_sliding_layers``); the others attend to everything.
"""

from __future__ import annotations

from .decoder import ArchSpec, DecoderForCausalLM
from .llama import qwen_sliding_layers


class Qwen3ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def arch_spec(hf_config, max_model_len: int) -> ArchSpec:
        window, sliding = qwen_sliding_layers(hf_config, max_model_len)
        bias = bool(getattr(hf_config, "attention_bias", False))
        return ArchSpec(qkv_bias=bias, o_bias=bias, qk_norm=True, sliding_window=window, sliding_layers=sliding)
