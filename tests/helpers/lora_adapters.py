"""LoRA adapters in PEFT's layout for the test models (``benchmarks.lora.save_random_adapter`` writes
``adapter_config.json`` and ``adapter_model.safetensors`` with PEFT's tensor names), and the oracle:
transformers' model with each adapted weight replaced by ``W + scale * B @ A`` (the dense reference of
``x @ (W + scale B A)^T``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from benchmarks.lora import save_random_adapter as save_adapter

__all__ = ["merged_hf_model", "save_adapter"]


def merged_hf_model(model_path: str, adapter: str):
    """transformers' fp32 model of ``model_path`` with the adapter at ``adapter`` merged into its weights."""
    from safetensors import safe_open

    from helpers.hf_oracle import load_hf_model

    model = load_hf_model(model_path)
    config = json.loads((Path(adapter) / "adapter_config.json").read_text())
    rank = config["r"]
    scale = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    params = dict(model.named_parameters())
    with safe_open(str(Path(adapter) / "adapter_model.safetensors"), framework="pt") as handle:
        for key in handle.keys():
            if ".lora_A." not in key:
                continue
            a, b = handle.get_tensor(key), handle.get_tensor(key.replace(".lora_A.", ".lora_B."))
            name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            with torch.no_grad():
                params[name].add_(scale * (b @ a))
    return model
