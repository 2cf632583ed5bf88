"""Qwen2 / Qwen2.5: the Llama layout with biases on the q/k/v projections (none on o_proj or the MLP).

Configs that enable the sliding window (``use_sliding_window``) are rejected.
"""

from __future__ import annotations

from .decoder import ArchSpec, DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def arch_spec(hf_config, max_model_len: int) -> ArchSpec:
        if getattr(hf_config, "use_sliding_window", False):
            raise ValueError("model: Qwen2 configs with use_sliding_window=true are not supported")
        return ArchSpec(qkv_bias=True)
