"""Tiny random Hugging Face model folders (safetensors), one per supported architecture.

Weights come from a fixed seed with a larger ``initializer_range`` than the default, so logits are
well separated and greedy decoding is not decided by float noise (no near-ties that a summation order
could flip).
"""

from __future__ import annotations

import torch

TINY_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=251,
                   max_position_embeddings=512, initializer_range=0.25, rms_norm_eps=1e-6,
                   bos_token_id=1, eos_token_id=2)
TINY_LLAMA_EOS = 1   # save_tiny_llama's EOS token


def tiny_config(kind: str):
    from transformers import LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

    if kind == "llama":   # llama3 rope scaling, GQA 4:2, untied LM head, odd vocab (uneven TP split)
        return LlamaConfig(**TINY_COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                           architectures=["LlamaForCausalLM"])
    if kind == "mistral":  # sliding_window (4096) longer than the context (512): plain causal attention
        return MistralConfig(**TINY_COMMON, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                             architectures=["MistralForCausalLM"])
    if kind == "mistral-window":  # an 8-token sliding window: every prompt and generation runs past it
        return MistralConfig(**TINY_COMMON, num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                             architectures=["MistralForCausalLM"])
    if kind == "qwen2":   # qkv bias, tied embeddings
        return Qwen2Config(**TINY_COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                           architectures=["Qwen2ForCausalLM"])
    if kind == "qwen2-window":   # use_sliding_window: layer 0 attends to everything, layer 1 within 8 tokens
        return Qwen2Config(**TINY_COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                           use_sliding_window=True, sliding_window=8, max_window_layers=1,
                           architectures=["Qwen2ForCausalLM"])
    if kind == "qwen3-window":   # the same per-layer window on Qwen3
        return Qwen3Config(**TINY_COMMON, num_attention_heads=4, num_key_value_heads=1, head_dim=24,
                           tie_word_embeddings=False, use_sliding_window=True, sliding_window=8, max_window_layers=1,
                           architectures=["Qwen3ForCausalLM"])
    if kind == "qwen3":   # q/k norm, explicit head_dim != hidden / heads, a single KV head (replicated at TP=2)
        return Qwen3Config(**TINY_COMMON, num_attention_heads=4, num_key_value_heads=1, head_dim=24,
                           tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"])
    if kind == "phi3":    # fused qkv_proj / gate_up_proj in the checkpoint, a 16-token sliding window
        return Phi3Config(**TINY_COMMON, num_attention_heads=4, num_key_value_heads=2, sliding_window=16,
                          original_max_position_embeddings=512, pad_token_id=0, tie_word_embeddings=False,
                          architectures=["Phi3ForCausalLM"])
    if kind == "phi3-longrope":   # LongRoPE's short factors and an attention factor that scales cos / sin
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
                "short_factor": [1.0 + 0.25 * i for i in range(8)], "long_factor": [4.0 + i for i in range(8)],
                "original_max_position_embeddings": 512, "attention_factor": 1.2}
        return Phi3Config(**TINY_COMMON, num_attention_heads=4, num_key_value_heads=2, sliding_window=None,
                          original_max_position_embeddings=512, pad_token_id=0, tie_word_embeddings=False,
                          rope_parameters=rope, architectures=["Phi3ForCausalLM"])
    if kind == "qwen3-moe":   # 6 experts, top-2 renormalised; layer 1 of 3 dense (mlp_only_layers)
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**{**TINY_COMMON, "num_hidden_layers": 3}, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2,
                              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                              tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"])
    if kind == "qwen3-moe-48":   # experts of 48 rows: at TP=2 rank 1's slice starts mid-group (groups of 16)
        config = tiny_config("qwen3-moe")
        config.moe_intermediate_size = 48
        return config
    if kind == "qwen2-moe":   # 4 experts, top-2 not renormalised, a gated shared expert, qkv bias
        from transformers import Qwen2MoeConfig

        return Qwen2MoeConfig(**TINY_COMMON, num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                              norm_topk_prob=False, tie_word_embeddings=False, architectures=["Qwen2MoeForCausalLM"])
    if kind == "mixtral":   # block_sparse_moe with w1 / w3 / w2, top-2 of 4 renormalised
        from transformers import MixtralConfig

        return MixtralConfig(**{**TINY_COMMON, "intermediate_size": 32}, num_attention_heads=4, num_key_value_heads=2,
                             num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                             architectures=["MixtralForCausalLM"])
    if kind == "gemma2":   # soft-capped attention scores (cap 2: it binds) and final logits, alternating layers
        from transformers import Gemma2Config

        return Gemma2Config(**{**TINY_COMMON, "num_hidden_layers": 3}, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=2.0,
                            final_logit_softcapping=5.0, pad_token_id=0, architectures=["Gemma2ForCausalLM"])
    if kind == "gemma3":   # (1 + w) norms, sandwich norms, GELU-tanh, scaled embeddings, local/global layers
        from transformers import Gemma3TextConfig

        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}}
        return Gemma3TextConfig(**{**TINY_COMMON, "num_hidden_layers": 3}, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                rope_parameters=rope, pad_token_id=0, architectures=["Gemma3ForCausalLM"])
    if kind == "gpt-oss":   # sinks, alternating 8-token windows, biases, YaRN, 4 biased experts with a clamped SwiGLU
        from transformers import GptOssConfig

        rope = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 64, "rope_theta": 10_000.0}
        return GptOssConfig(**{**TINY_COMMON, "num_hidden_layers": 3}, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                            swiglu_limit=1.5, rope_parameters=rope, pad_token_id=0,
                            architectures=["GptOssForCausalLM"])
    if kind in ("qwen3.5", "qwen3.5-moe"):   # hybrid: 3 linear-attention layers (Gated DeltaNet), then gated attention
        from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

        common = {**TINY_COMMON, "num_hidden_layers": 4}
        hybrid = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                      tie_word_embeddings=False, pad_token_id=0)
        if kind == "qwen3.5":
            return Qwen3_5TextConfig(**common, **hybrid, architectures=["Qwen3_5ForCausalLM"])
        del common["intermediate_size"]
        return Qwen3_5MoeTextConfig(**common, **hybrid, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, architectures=["Qwen3_5MoeForCausalLM"])
    if kind == "qwen3.5-vl":   # the multimodal checkpoint (vision tower included), served as its text model
        from transformers import Qwen3_5Config

        return Qwen3_5Config(text_config=tiny_config("qwen3.5").to_dict(), tie_word_embeddings=False,
                             vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                out_hidden_size=64), architectures=["Qwen3_5ForConditionalGeneration"])
    if kind in ("gemma4", "gemma4-moe"):
        return _gemma4_config(kind)
    if kind == "gemma4-wide":   # the released checkpoints' head sizes: 256 on sliding layers, 512 on full ones
        return _gemma4_config("gemma4", head_dim=256, global_head_dim=512)
    if kind == "gemma4-vl":   # the multimodal checkpoint (a vision tower included), served as its text model
        from transformers import Gemma4Config

        return Gemma4Config(text_config=tiny_config("gemma4").to_dict(), audio_config=None,
                            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=2, head_dim=16),
                            architectures=["Gemma4ForConditionalGeneration"])
    if kind.endswith("-untied"):   # the family's config with its own LM head (lm_head.weight in the checkpoint)
        config = tiny_config(kind.removesuffix("-untied"))
        config.tie_word_embeddings = False
        return config
    raise ValueError(kind)


GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
               "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}


def _gemma4_config(kind: str, head_dim: int = 32, global_head_dim: int = 64):
    """``gemma4``: 6 layers, sliding (8-token window) and full, the full ones with their own head_dim (64 against
    32) and, with attention_k_eq_v, one KV head (values = keys, replicated at TP=2); per-layer inputs; the last 3
    layers read earlier layers' KV (a sliding and a full source) with double-wide MLPs; soft-capped logits (cap 10:
    it binds). ``gemma4-moe``: 4 layers, routed experts (4, top-2) beside every dense MLP, attention biases, no
    k_eq_v (the full layers keep 2 KV heads and a v_proj), no per-layer inputs, no KV sharing."""
    from transformers import Gemma4TextConfig

    common = {**TINY_COMMON, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": head_dim,
              "global_head_dim": global_head_dim, "sliding_window": 8, "rope_parameters": GEMMA4_ROPE,
              "pad_token_id": 0, "architectures": ["Gemma4ForCausalLM"]}
    local, full = "sliding_attention", "full_attention"
    if kind == "gemma4":
        return Gemma4TextConfig(**{**common, "num_hidden_layers": 6},
                                layer_types=[local, local, full, local, local, full], attention_k_eq_v=True,
                                num_global_key_value_heads=1, num_kv_shared_layers=3, use_double_wide_mlp=True,
                                hidden_size_per_layer_input=16,
                                vocab_size_per_layer_input=TINY_COMMON["vocab_size"], final_logit_softcapping=10.0)
    return Gemma4TextConfig(**{**common, "num_hidden_layers": 4}, layer_types=[local, full, local, full],
                            attention_bias=True, hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4,
                            top_k_experts=2, moe_intermediate_size=32)


def _perturb_gemma4(model) -> None:
    """Gemma 4 initialises its norms, layer scalars and router scales to 1 and biases to 0: draw them, so that a
    mistake in any of them (a ``1 + w`` norm, a missed scalar) changes the tokens. The (tied) embedding is shrunk
    to std 0.05: scaled by sqrt(hidden_size) at the full 0.25 it outweighs every layer, and greedy decoding just
    repeats the last token, blind to what the layers do; the final norm's weight is scaled up instead, so that the
    top logits stay apart."""
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(0.2)
        for name, param in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("norm.weight", "_1.weight", "_2.weight", "router.scale")):
                param.normal_(1.0, 0.25)
            elif name.endswith(("layer_scalar", "per_expert_scale")):
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.25)
        final_norm = model.get_decoder().norm.weight          # logits 4x larger: wider margins between tokens
        final_norm.mul_(4.0)


def save_tiny_model(kind: str, folder, max_shard_size: str | None = None) -> str:
    """A ``tiny_config(kind)`` model with seeded weights saved to ``folder``; returns the folder."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    config = tiny_config(kind)
    if kind == "qwen3.5-vl":
        from transformers import Qwen3_5ForConditionalGeneration

        model = Qwen3_5ForConditionalGeneration(config).to(torch.float32)
    elif kind == "gemma4-vl":
        from transformers import Gemma4ForConditionalGeneration

        model = Gemma4ForConditionalGeneration(config).to(torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if kind.startswith("gpt-oss"):   # transformers zeroes biases and draws small sinks: make both matter
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("bias", "sinks")):
                    param.normal_(0.0, 2.0 if name.endswith("sinks") else 0.25)
    if kind.startswith("gemma4"):
        _perturb_gemma4(model)
    if kind.startswith("qwen3.5"):   # mild decays, so each sequence's recurrent state carries over many tokens
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("A_log"):
                    param.copy_(torch.empty_like(param).uniform_(0.02, 0.2).log())
                elif name.endswith(("dt_bias", "layernorm.weight", "q_norm.weight", "k_norm.weight", "norm.weight")):
                    param.normal_(1.0 if name.endswith("linear_attn.norm.weight") else 0.0, 0.25)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(folder), **kwargs)
    return str(folder)


def save_tiny_llama(folder) -> str:
    """A tiny Llama with a 512-token vocabulary and EOS = ``TINY_LLAMA_EOS`` (the cluster tests' model,
    fast breadth for engine tests) saved to ``folder``; returns the folder."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.3, bos_token_id=0, eos_token_id=TINY_LLAMA_EOS,
                         tie_word_embeddings=False)
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(folder)
    GenerationConfig(bos_token_id=0, eos_token_id=TINY_LLAMA_EOS).save_pretrained(folder)
    return str(folder)


def save_tiny_reranker(folder, tokenizer_path: str) -> str:
    """A Qwen3-Reranker-shaped random model: Qwen3ForCausalLM with the tokenizer of ``tokenizer_path`` (the default
    model's has single "yes" and "no" tokens) and that tokenizer's vocabulary size."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    config = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=len(tokenizer), max_position_embeddings=512,
                         initializer_range=0.25, tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(7)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def save_tiny_classifier(folder, tokenizer_path: str, num_labels: int = 1) -> str:
    """A reranker converted to sequence classification: Qwen3ForSequenceClassification (a ``score`` head of
    ``num_labels`` rows, no LM head) with the tokenizer of ``tokenizer_path``."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    config = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=len(tokenizer), max_position_embeddings=512,
                         initializer_range=0.25, tie_word_embeddings=False, num_labels=num_labels,
                         pad_token_id=tokenizer.pad_token_id, architectures=["Qwen3ForSequenceClassification"])
    torch.manual_seed(8)
    Qwen3ForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)
