"""Hugging Face ``architectures`` name -> pagedray model class.

The table is an immutable mapping; an architecture outside it is rejected with a ValueError that
lists the supported ones.
"""

from __future__ import annotations

from types import MappingProxyType

from .decoder import DecoderForCausalLM
from .gemma3 import Gemma2ForCausalLM, Gemma3ForCausalLM
from .gemma4 import Gemma4ForCausalLM
from .gpt_oss import GptOssForCausalLM
from .llama import LlamaForCausalLM
from .phi3 import Phi3ForCausalLM
from .qwen2 import Qwen2ForCausalLM
from .qwen3 import Qwen3ForCausalLM
from .qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from .qwen3_moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

MODEL_CLASSES = MappingProxyType({
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    # their multimodal checkpoints, text only (model_info.TEXT_OF_MULTIMODAL: the text config and weights)
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4ForCausalLM,
    # a score head instead of the LM head (decoder.is_classifier): rerankers converted to sequence classification
    "LlamaForSequenceClassification": LlamaForCausalLM,
    "Qwen2ForSequenceClassification": Qwen2ForCausalLM,
    "Qwen3ForSequenceClassification": Qwen3ForCausalLM,
})

SUPPORTED_ARCHITECTURES = tuple(MODEL_CLASSES)


def architecture_of(hf_config) -> str:
    """The first supported name in ``config.architectures``, or ValueError listing the supported ones."""
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in MODEL_CLASSES:
            return name
    raise ValueError(f"model: architecture {names or 'unknown'} is not supported; supported architectures: "
                     f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def model_class(hf_config) -> type[DecoderForCausalLM]:
    return MODEL_CLASSES[architecture_of(hf_config)]
