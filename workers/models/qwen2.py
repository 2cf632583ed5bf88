"""Qwen2 / Qwen2.5: the Llama layout with biases on the q/k/v projections (none on o_proj or the MLP).

With ``use_sliding_window`` the layers that ``layer_types`` marks (from ``max_window_layers`` on) attend
within ``sliding_window`` (``llama.qwen_sliding_layers``); the others attend to everything.
"""

from __future__ import annotations

from .decoder import ArchSpec, DecoderForCausalLM
from .llama import qwen_sliding_layers


class Qwen2ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def arch_spec(hf_config, max_model_len: int) -> ArchSpec:
        window, sliding = qwen_sliding_layers(hf_config, max_model_len)
        return ArchSpec(qkv_bias=True, sliding_window=window, sliding_layers=sliding)
