"""gpt-oss (``GptOssForCausalLM``, 20B / 120B): the shared decoder with

- attention sinks: a learned logit per query head (``self_attn.sinks``) joins every softmax and takes
  probability from the keys without adding a value (``kernels.paged_attention(..., sinks=)``; the one-call
  CPU decode and the C prefill kernel do not take them, so its layers go through the per-layer path);
- ``layer_types`` alternating ``sliding_attention`` (``sliding_window``, 128) and ``full_attention``;
- q/k/v and o biases (``attention_bias``), YaRN rope (``rope_parameters``; rotary.py);
- a MoE on every layer with a router bias, softmax over the top-k logits and biased experts with a clamped
  SwiGLU (``layers/clamped_moe.py``: a loop over the picked experts on CPU, the grouped Triton MoE on CUDA),
  MXFP4 experts dequantized at load on CPU and kept in 4 bits on CUDA;
- an untied LM head unless ``tie_word_embeddings``.

The harmony chat format (channels, tool calls) is the front's (deploy/openai). Refused up front, naming the
field: an activation other than SiLU, a ``layer_types`` entry other than full or sliding attention.
"""

from __future__ import annotations

from ..layers.moe import MoESpec
from .decoder import ArchSpec, DecoderForCausalLM
from .llama import layer_types_of, sliding_window_of


class GptOssForCausalLM(DecoderForCausalLM):
    @staticmethod
    def arch_spec(hf_config, max_model_len: int) -> ArchSpec:
        experts, top_k = hf_config.num_local_experts, hf_config.num_experts_per_tok
        if experts <= 0 or not 0 < top_k <= experts:
            raise ValueError(f"model: num_experts_per_tok {top_k} of {experts} experts is not a valid routing")
        types = layer_types_of(hf_config)
        limit = getattr(hf_config, "swiglu_limit", 7.0)
        moe = MoESpec(experts, top_k, hf_config.intermediate_size, norm_topk_prob=True,
                      swiglu_limit=float(limit), swiglu_alpha=float(getattr(hf_config, "swiglu_alpha", 1.702)))
        bias = bool(getattr(hf_config, "attention_bias", True))
        return ArchSpec(qkv_bias=bias, o_bias=bias, sliding_window=sliding_window_of(hf_config, max_model_len),
                        sliding_layers=tuple(t == "sliding_attention" for t in types), moe=moe,
                        moe_layers=(True,) * hf_config.num_hidden_layers, attn_sinks=True)
