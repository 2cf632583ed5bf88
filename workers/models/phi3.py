"""Phi-3 / Phi-4 (``Phi3ForCausalLM``): the Llama layout with ``qkv_proj`` and ``gate_up_proj`` fused in
the checkpoint (split across ranks at load: ``ColumnParallelLinear.load_fused``), Mistral's sliding
window (``sliding_window``, 2047 in Phi-3-mini-4k) and, for the 128k-context checkpoints, LongRoPE
(``layers/rotary.py``: which factors, and where that differs from transformers).

Not supported yet (a ValueError naming it before any weight is read): a partial rotary
(``partial_rotary_factor`` below 1, Phi-4-mini).
"""

from __future__ import annotations

from .decoder import ArchSpec, DecoderForCausalLM
from .llama import sliding_window_of


class Phi3ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def arch_spec(hf_config, max_model_len: int) -> ArchSpec:
        rope = dict(getattr(hf_config, "rope_parameters", None) or {}) | dict(getattr(hf_config, "rope_scaling", None)
                                                                              or {})
        partial = rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"model: partial_rotary_factor {partial} is not supported (only 1.0)")
        return ArchSpec(fused_checkpoint=True, sliding_window=sliding_window_of(hf_config, max_model_len))
