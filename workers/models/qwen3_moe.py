"""The mixture-of-experts families (experts: ``layers/moe.py``).

- Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (q/k norm).
- Qwen2-MoE (``Qwen2MoeForCausalLM``): Qwen2's attention (q/k/v bias) and a shared expert with its sigmoid
  gate next to the routed ones.
- Both: sparse on the layers transformers makes sparse (not in ``mlp_only_layers``, index + 1 a multiple of
  ``decoder_sparse_step``); the others keep a dense MLP of ``intermediate_size``.
- Mixtral (``MixtralForCausalLM``): Mistral's attention (and window), every layer sparse, the router's top-k
  weights always renormalised, checkpoint module ``block_sparse_moe`` with experts ``w1 / w3 / w2``.
"""

from __future__ import annotations

from ..layers.moe import MoESpec
from .decoder import ArchSpec, DecoderForCausalLM
from .llama import qwen_sliding_layers, sliding_window_of


def _experts(num_experts: int, top_k: int) -> None:
    if num_experts <= 0 or not 0 < top_k <= num_experts:
        raise ValueError(f"model: num_experts_per_tok {top_k} of {num_experts} experts is not a valid routing")


def _qwen_moe(hf_config, shared: int) -> tuple[MoESpec, tuple[bool, ...]]:
    _experts(hf_config.num_experts, hf_config.num_experts_per_tok)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(hf_config.num_hidden_layers))
    moe = MoESpec(hf_config.num_experts, hf_config.num_experts_per_tok, hf_config.moe_intermediate_size,
                  bool(getattr(hf_config, "norm_topk_prob", False)), shared_intermediate_size=shared)
    return moe, sparse


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    @staticmethod
    def arch_spec(hf_config, max_model_len: int) -> ArchSpec:
        window, sliding = qwen_sliding_layers(hf_config, max_model_len)
        bias = bool(getattr(hf_config, "attention_bias", False))
        moe, sparse = _qwen_moe(hf_config, 0)
        return ArchSpec(qkv_bias=bias, o_bias=bias, qk_norm=True, sliding_window=window, sliding_layers=sliding,
                        moe=moe, moe_layers=sparse)


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    @staticmethod
    def arch_spec(hf_config, max_model_len: int) -> ArchSpec:
        window, sliding = qwen_sliding_layers(hf_config, max_model_len)
        moe, sparse = _qwen_moe(hf_config, getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)
        return ArchSpec(qkv_bias=bool(getattr(hf_config, "qkv_bias", True)), sliding_window=window,
                        sliding_layers=sliding, moe=moe, moe_layers=sparse)


class MixtralForCausalLM(DecoderForCausalLM):
    @staticmethod
    def arch_spec(hf_config, max_model_len: int) -> ArchSpec:
        _experts(hf_config.num_local_experts, hf_config.num_experts_per_tok)
        moe = MoESpec(hf_config.num_local_experts, hf_config.num_experts_per_tok, hf_config.intermediate_size,
                      norm_topk_prob=True, block="block_sparse_moe", names=("w1", "w3", "w2"))
        return ArchSpec(sliding_window=sliding_window_of(hf_config, max_model_len), moe=moe,
                        moe_layers=(True,) * hf_config.num_hidden_layers)
