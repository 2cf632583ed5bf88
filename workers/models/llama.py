"""Llama family: Llama 2 / 3.x (incl. llama3 rope scaling), SmolLM2, and Mistral.

Mistral checkpoints share the Llama layout plus ``sliding_window``: each query attends to the last
``sliding_window`` positions (itself included), the mask transformers applies; the kernels take the
window. A window at least as long as ``max_model_len`` never cuts anything and is dropped. The KV
blocks behind the window are kept (and still count towards the sequence's blocks): the window changes
what attention reads, not what the cache holds.
"""

from __future__ import annotations

from .decoder import ArchSpec, DecoderForCausalLM


def sliding_window_of(hf_config, max_model_len: int) -> int | None:
    window = getattr(hf_config, "sliding_window", None)
    if window is None or window >= max_model_len:
        return None
    if type(window) is not int or window < 1:   # noqa: E721
        raise ValueError(f"model: sliding_window must be a positive integer, got {window!r}")
    return window


LAYER_TYPES = ("full_attention", "sliding_attention")


def qwen_sliding_layers(hf_config, max_model_len: int) -> tuple[int | None, tuple[bool, ...] | None]:
    """(window, which layers use it) of a Qwen2 / Qwen3 config: with ``use_sliding_window`` the layers that
    ``layer_types`` marks ``sliding_attention`` (transformers derives them from ``max_window_layers``: the
    layers from that index on slide); without it, none."""
    if not getattr(hf_config, "use_sliding_window", False):
        return None, None
    window = sliding_window_of(hf_config, max_model_len)
    if getattr(hf_config, "layer_types", None) is None:
        first = getattr(hf_config, "max_window_layers", 0)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(hf_config.num_hidden_layers)]
    else:
        types = layer_types_of(hf_config)
    return window, tuple(t == "sliding_attention" for t in types)


def layer_types_of(hf_config) -> list[str]:
    """transformers' per-layer ``layer_types``; ValueError naming the kinds that are not full or sliding."""
    types = list(hf_config.layer_types)
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"model: layer_types {unknown} are not supported (only {', '.join(LAYER_TYPES)})")
    return types


class LlamaForCausalLM(DecoderForCausalLM):
    @staticmethod
    def arch_spec(hf_config, max_model_len: int) -> ArchSpec:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return ArchSpec(qkv_bias=attention_bias, o_bias=attention_bias,
                        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
                        sliding_window=sliding_window_of(hf_config, max_model_len))
