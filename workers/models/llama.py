"""Llama family: Llama 2 / 3.x (incl. llama3 rope scaling), SmolLM2, and Mistral without a sliding window.

Mistral checkpoints share the Llama layout; a Mistral config whose ``sliding_window`` is shorter than
the context the engine will use is rejected (the prefill kernel has no sliding window), naming
max_model_len so the user can lower it to the window.
"""

from __future__ import annotations

from .decoder import ArchSpec, DecoderForCausalLM


def check_no_sliding_window(hf_config, max_model_len: int) -> None:
    window = getattr(hf_config, "sliding_window", None)
    if window is not None and window < max_model_len:
        raise ValueError(f"max_model_len: {max_model_len} exceeds the model's sliding_window={window}, "
                         "which is not supported; set max_model_len <= the window")


class LlamaForCausalLM(DecoderForCausalLM):
    @staticmethod
    def arch_spec(hf_config, max_model_len: int) -> ArchSpec:
        check_no_sliding_window(hf_config, max_model_len)
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return ArchSpec(qkv_bias=attention_bias, o_bias=attention_bias,
                        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)))
