"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (q/k norm) with sparse expert MLPs
(``layers/moe.py``) on the layers transformers makes sparse: those not in ``mlp_only_layers`` whose index + 1
is a multiple of ``decoder_sparse_step``; the others keep a dense MLP of ``intermediate_size``.
"""

from __future__ import annotations

from ..layers.moe import MoESpec
from .decoder import ArchSpec, DecoderForCausalLM
from .llama import qwen_sliding_layers


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    @staticmethod
    def arch_spec(hf_config, max_model_len: int) -> ArchSpec:
        window, sliding = qwen_sliding_layers(hf_config, max_model_len)
        bias = bool(getattr(hf_config, "attention_bias", False))
        experts = hf_config.num_experts
        if experts <= 0 or not 0 < hf_config.num_experts_per_tok <= experts:
            raise ValueError(f"model: num_experts_per_tok {hf_config.num_experts_per_tok} of num_experts {experts}")
        dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
        step = getattr(hf_config, "decoder_sparse_step", 1) or 1
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(hf_config.num_hidden_layers))
        moe = MoESpec(experts, hf_config.num_experts_per_tok, hf_config.moe_intermediate_size,
                      bool(getattr(hf_config, "norm_topk_prob", False)))
        return ArchSpec(qkv_bias=bias, o_bias=bias, qk_norm=True, sliding_window=window, sliding_layers=sliding,
                        moe=moe, moe_layers=sparse)
