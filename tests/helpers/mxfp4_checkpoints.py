"""A tiny gpt-oss checkpoint whose experts are stored in MXFP4 (blocks and scales, ``quant_method: mxfp4``), with a
plain twin holding the same values dequantized by transformers' own converter (the oracle, independent of
pagedray's dequantizer). Used by tests/workers/test_gpt_oss.py (CPU) and tests/workers/test_worker_gpu.py (CUDA)."""

from __future__ import annotations

import json

import torch
from pagedray.workers.weights.quantization import quantize_mxfp4

from helpers.tiny_models import tiny_config


def mxfp4_checkpoint(tmp_path) -> tuple[str, str]:
    """The tiny gpt-oss with its experts rounded to MXFP4: (a folder holding blocks and scales with
    ``quant_method: mxfp4``, a plain folder holding the same values dequantized by transformers' own converter:
    the oracle, independent of pagedray's dequantizer)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(tiny_config("gpt-oss"), dtype=torch.float32)
    quantized = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("gate_up_proj", "down_proj")):
                blocks, scales = quantize_mxfp4(param)
                quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            elif name.endswith(("bias", "sinks")):
                param.normal_(0.0, 2.0 if name.endswith("sinks") else 0.25)
    plain, packed = tmp_path / "plain", tmp_path / "mxfp4"
    model.save_pretrained(str(plain))
    model.save_pretrained(str(packed))
    tensors = {k: v for k, v in load_file(str(packed / "model.safetensors")).items()
               if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**tensors, **quantized}, str(packed / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (packed / "config.json").write_text(json.dumps(config))
    return str(packed), str(plain)
