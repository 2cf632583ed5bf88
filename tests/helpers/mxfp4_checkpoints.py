"""A tiny gpt-oss checkpoint whose experts are stored in MXFP4 (blocks and scales, ``quant_method: mxfp4``), with a
plain twin holding the same values dequantized by transformers' own converter (the oracle, independent of
pagedray's dequantizer). Used by tests/workers/test_gpt_oss.py (CPU) and tests/workers/test_worker_gpu.py (CUDA)."""

from __future__ import annotations

import json

import torch
from pagedray.workers.weights.quantization import FP4_E2M1_VALUES

from helpers.tiny_models import tiny_config


def to_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, in, out] (transformers' expert layout) -> (blocks uint8 [E, out, in / 32, 16], scales uint8
    [E, out, in / 32]): per 32 inputs of an output row the smallest power of two that fits max |x| in 6, each
    value rounded to the nearest e2m1 value."""
    rows = weight.transpose(1, 2).float()                                       # [E, out, in]
    groups = rows.reshape(*rows.shape[:2], -1, 32)                               # [E, out, G, 32]
    amax = groups.abs().amax(-1).clamp_min(2.0 ** -100)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)               # [E, out, G]
    lut = torch.tensor(FP4_E2M1_VALUES)
    codes = ((groups / torch.exp2(exponent)[..., None])[..., None] - lut).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)                         # [E, out, G, 16]
    return blocks, (exponent + 127).to(torch.uint8)


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
                blocks, scales = to_mxfp4(param)
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
