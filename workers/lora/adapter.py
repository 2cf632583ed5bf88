"""A LoRA adapter in PEFT's layout, read and checked against the model it adapts.

A folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ``use_rslora``) and
``adapter_model.safetensors`` with, per adapted module, ``...layers.{i}.{self_attn|mlp}.{name}.lora_A.weight``
[r, in] and ``lora_B.weight`` [out, r]. The adapted weight is ``W + scale * B @ A`` with ``scale =
lora_alpha / r`` (rsLoRA: ``lora_alpha / sqrt(r)``).

Accepted: targets among q/k/v/o and gate/up/down projections of a dense decoder (``TARGETS``; a hybrid model's
q/k/v/o exist in its full-attention layers only, and its gated q_proj holds each head's query and gate rows), any
rank up
to the engine's ``max_lora_rank``, no bias (``bias: none``), no DoRA, no ``modules_to_save`` (those change
weights other than the low-rank pair). Anything else is a ``LoRAError`` (a ValueError) naming the adapter
and what is wrong, raised before any state changes: ``read_adapter_config`` checks the config and the
tensor shapes from the file's header alone (what the engine does at admission); ``read_adapter`` loads
the tensors.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS


class LoRAError(ValueError):
    """A LoRA adapter that cannot be served: its message names the adapter and the problem."""


@dataclass(frozen=True)
class ModuleShapes:
    """(in_features, out_features) of each target module of the model, its layer count, and the layers that have
    the attention targets (None: every layer; a hybrid model: its full-attention layers)."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]
    attention_layers: frozenset[int] | None = None

    @classmethod
    def of_dims(cls, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, num_layers: int,
                dense_mlp: bool = True, gated_query: bool = False, attention_layers=None) -> ModuleShapes:
        """``gated_query``: q_proj holds a gate row beside each query row (Qwen3.5's gated attention)."""
        shapes = {"q_proj": (hidden, heads * head_dim * (2 if gated_query else 1)),
                  "k_proj": (hidden, kv_heads * head_dim), "v_proj": (hidden, kv_heads * head_dim),
                  "o_proj": (heads * head_dim, hidden)}
        if dense_mlp:
            shapes.update(gate_proj=(hidden, intermediate), up_proj=(hidden, intermediate),
                          down_proj=(intermediate, hidden))
        return cls(num_layers, shapes, None if attention_layers is None else frozenset(attention_layers))

    def has(self, layer: int, target: str) -> bool:
        """Whether layer ``layer`` has module ``target``."""
        if not 0 <= layer < self.num_layers or target not in self.shapes:
            return False
        return target not in ATTENTION_TARGETS or self.attention_layers is None or layer in self.attention_layers


@dataclass(frozen=True)
class AdapterConfig:
    name: str
    rank: int
    scale: float
    targets: tuple[str, ...]


@dataclass
class Adapter:
    """A checked adapter: ``pairs[(layer, target)] = (A [r, in], B [out, r])``, float32 on the host."""

    config: AdapterConfig
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _fail(name: str, message: str) -> LoRAError:
    return LoRAError(f"lora adapter {name!r}: {message}")


def _module_of(tensor_name: str) -> tuple[int, str, str] | None:
    """(layer, target, 'A' | 'B') of a PEFT tensor name, or None when it is not a LoRA pair's."""
    parts = tensor_name.split(".")
    if len(parts) < 5 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
        return None
    try:
        layer = int(parts[parts.index("layers") + 1])
    except (ValueError, IndexError):
        return None
    return layer, parts[-3], parts[-2][-1]


def read_adapter_config(name: str, path: str | Path, model: ModuleShapes, max_rank: int) -> AdapterConfig:
    """The adapter at ``path`` checked against ``model`` and ``max_rank`` from its config and the tensor
    shapes in its file header (no tensor is read). LoRAError names what is wrong."""
    folder = Path(path)
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise _fail(name, f"no {CONFIG_FILE} in {folder}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise _fail(name, f"{folder / CONFIG_FILE} is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise _fail(name, f"{CONFIG_FILE} is not a JSON object")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _fail(name, f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise _fail(name, f"rank {rank} is over max_lora_rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise _fail(name, f"lora_alpha must be a number, got {alpha!r}")
    for key, allowed in (("bias", ("none", None)), ("use_dora", (False, None)), ("modules_to_save", (None, []))):
        if config.get(key) not in allowed:
            raise _fail(name, f"{key}={config.get(key)!r} is not supported (only the low-rank pairs are served)")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        raise _fail(name, f"target_modules as a pattern ({targets!r}) is not supported; list the modules")
    if not isinstance(targets, list) or not targets:
        raise _fail(name, f"target_modules must be a non-empty list, got {targets!r}")
    for target in targets:
        if target not in model.shapes:
            raise _fail(name, f"target module {target!r} is not one this model can adapt "
                              f"({', '.join(sorted(model.shapes))})")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    _check_shapes(name, folder, model, rank, set(targets))
    return AdapterConfig(name, rank, float(scale), tuple(targets))


def _check_shapes(name: str, folder: Path, model: ModuleShapes, rank: int, targets: set[str]) -> None:
    file = folder / WEIGHTS_FILE
    if not file.is_file():
        raise _fail(name, f"no {WEIGHTS_FILE} in {folder}")
    try:
        with safe_open(str(file), framework="pt") as handle:
            shapes = {key: list(handle.get_slice(key).get_shape()) for key in handle.keys()}
    except Exception as exc:   # safetensors raises its own error types for a corrupt header
        raise _fail(name, f"{file} is not a readable safetensors file ({exc})") from None
    found = set()
    for key, shape in shapes.items():
        module = _module_of(key)
        if module is None:
            raise _fail(name, f"tensor {key!r} is not a LoRA A/B weight of a decoder layer")
        layer, target, side = module
        if target not in targets:
            raise _fail(name, f"tensor {key!r} adapts {target!r}, which target_modules does not list")
        if not 0 <= layer < model.num_layers:
            raise _fail(name, f"tensor {key!r} names layer {layer}; the model has {model.num_layers}")
        if not model.has(layer, target):
            raise _fail(name, f"tensor {key!r} adapts {target!r} of layer {layer}, which has none (a "
                              "linear-attention layer: only the full-attention layers have q/k/v/o)")
        fan_in, fan_out = model.shapes[target]
        expected = [rank, fan_in] if side == "A" else [fan_out, rank]
        if shape != expected:
            raise _fail(name, f"tensor {key!r} has shape {shape}, expected {expected}")
        found.add((layer, target, side))
    for layer, target in {(layer, target) for layer, target, _ in found}:
        for side in "AB":
            if (layer, target, side) not in found:
                raise _fail(name, f"layers.{layer}.{target} has lora_A or lora_B but not both")
    if not found:
        raise _fail(name, f"{file} holds no LoRA weights")


def read_adapter(name: str, path: str | Path, model: ModuleShapes, max_rank: int) -> Adapter:
    """``read_adapter_config``'s checks, then every pair's tensors as float32."""
    config = read_adapter_config(name, path, model, max_rank)
    pairs: dict[tuple[int, str], list] = {}
    with safe_open(str(Path(path) / WEIGHTS_FILE), framework="pt") as handle:
        for key in handle.keys():
            layer, target, side = _module_of(key)
            pair = pairs.setdefault((layer, target), [None, None])
            pair[0 if side == "A" else 1] = handle.get_tensor(key).to(torch.float32)
    return Adapter(config, {module: (a, b) for module, (a, b) in pairs.items()})
