"""What the engine needs to know about a model folder without loading any weights.

``model_info(path)`` reads ``config.json`` (through transformers' AutoConfig) and, when present,
``generation_config.json``. It rejects unsupported architectures up front (ValueError listing the
supported ones), so the engine fails before starting any worker.

Models whose layers may differ in KV head shape or hold no KV (Gemma 4: ``kv_layer_shapes_of``) give the shape of
each layer that holds KV (``kv_layer_shapes``, all ranks together, in cache-row order: a block's bytes follow from
them, not from ``num_hidden_layers``; their config cannot be asked for one ``head_dim``); ``num_key_value_heads`` /
``head_dim`` are then the first such layer's.

EOS ids are the union, in order of first appearance, of ``config.eos_token_id`` and
``generation_config.eos_token_id`` (each an int, a list or absent): chat models often list the
end-of-turn token only in the generation config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..layers.partition import check_head_split
from .decoder import is_classifier
from .registry import architecture_of, model_class

# multimodal checkpoints served as text models: architecture -> where the language model's weights live (its
# config is the ``text_config``; the vision tower is not loaded, so a request with an image stays a 400)
TEXT_OF_MULTIMODAL = {"Qwen3_5ForConditionalGeneration": "model.language_model",
                      "Qwen3_5MoeForConditionalGeneration": "model.language_model",
                      "Gemma4ForConditionalGeneration": "model.language_model"}


def load_hf_config(model_path):
    """transformers config of a model folder; ValueError naming `model` when it cannot be read. For a multimodal
    checkpoint of ``TEXT_OF_MULTIMODAL``: its ``text_config``, carrying the checkpoint's ``architectures``, the
    tied-embeddings flag of the whole model and ``weights_prefix`` (where the language model's tensors are)."""
    from transformers import AutoConfig

    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model: {str(path)!r} is not a model folder (no config.json)")
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"model: cannot read the config of {str(path)!r}: {exc}") from exc
    names = list(getattr(config, "architectures", None) or [])
    prefix = next((TEXT_OF_MULTIMODAL[n] for n in names if n in TEXT_OF_MULTIMODAL), None)
    if prefix is None or getattr(config, "text_config", None) is None:
        return config
    text = config.text_config
    text.architectures = names
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    text.weights_prefix = prefix
    for name in ("eos_token_id", "bos_token_id"):
        if getattr(text, name, None) is None and getattr(config, name, None) is not None:
            setattr(text, name, getattr(config, name))
    return text


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _generation_eos(path: Path) -> list[int]:
    file = path / "generation_config.json"
    if not file.is_file():
        return []
    try:
        return _as_ids(json.loads(file.read_text()).get("eos_token_id"))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"model: {file} is not valid JSON ({exc})") from exc


@dataclass(frozen=True)
class ModelInfo:
    path: str
    architecture: str
    model_type: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    max_position_embeddings: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_size: int
    tie_word_embeddings: bool
    matryoshka: bool = False   # its config declares Matryoshka embeddings (is_matryoshka / matryoshka_dimensions)
    num_labels: int = 0        # a *ForSequenceClassification checkpoint: its score head's outputs (else 0)
    num_linear_layers: int = 0  # hybrid models: layers with a recurrent state instead of KV (cluster/hybrid.py)
    kv_layer_shapes: tuple[tuple[int, int], ...] = ()   # (KV heads, head_dim) per KV-holding layer (Gemma 4)

    @property
    def hybrid(self) -> bool:
        return self.num_linear_layers > 0

    def check_tensor_parallel_size(self, tensor_parallel_size: int) -> None:
        """ValueError naming tensor_parallel_size when the heads cannot be split over that many ranks."""
        for heads in sorted({self.num_key_value_heads} | {heads for heads, _ in self.kv_layer_shapes}):
            check_head_split(self.num_attention_heads, heads, tensor_parallel_size)


def model_info(model_path) -> ModelInfo:
    path = Path(model_path)
    cfg = load_hf_config(path)
    architecture = architecture_of(cfg)
    eos = []
    for token in _as_ids(getattr(cfg, "eos_token_id", None)) + _generation_eos(path):
        if token not in eos:
            eos.append(token)
    num_heads = cfg.num_attention_heads
    shapes_of = getattr(model_class(cfg), "kv_layer_shapes_of", None)
    shapes = tuple(shapes_of(cfg)) if shapes_of is not None else ()
    kv_heads, head_dim = shapes[0] if shapes else (getattr(cfg, "num_key_value_heads", None) or num_heads,
                                                   getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads)
    return ModelInfo(
        path=str(path),
        architecture=architecture,
        model_type=cfg.model_type,
        vocab_size=cfg.vocab_size,
        eos_token_ids=tuple(eos),
        bos_token_id=getattr(cfg, "bos_token_id", None),
        max_position_embeddings=cfg.max_position_embeddings,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=cfg.hidden_size,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        matryoshka=bool(getattr(cfg, "is_matryoshka", False) or getattr(cfg, "matryoshka_dimensions", None)),
        num_labels=int(getattr(cfg, "num_labels", 0)) if is_classifier(cfg) else 0,
        num_linear_layers=sum(kind == "linear_attention" for kind in getattr(cfg, "layer_types", None) or []),
        kv_layer_shapes=shapes,
    )
