"""A small round-to-nearest quantizer for the tests, written from the formats' definitions (not from the
loader): it turns a full-precision model folder into a GPTQ, AWQ or FP8 checkpoint, and writes the
weights that checkpoint stands for (the dequantized ones) as a plain folder for transformers to run.

GPTQ: 4 bits, per (group, output column) min / max with the zero point in [1, 15] (the ``gptq`` format
stores zero - 1; zero 0 would not survive it) or [0, 15] (``gptq_v2``); ``desc_act``: the groups are
formed over a random permutation of the input rows and ``g_idx`` maps each row to its group. Packing:
qweight words hold 8 consecutive input rows, qzeros words 8 consecutive output columns, lowest bits first.
AWQ: 4 bits, groups of input rows, words of 8 output columns in the order 0 2 4 6 1 3 5 7.
FP8: e4m3 values with a float32 scale per output row (``weight_scale``) or per block (``weight_scale_inv``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pack_words(values: torch.Tensor, dim: int, bits: int = 4, order=None) -> torch.Tensor:
    """int values in [0, 2^bits) -> int32 words of 32 / bits along ``dim`` (value k of a word, at bits
    ``bits * k``, is element ``per_word * w + order[k]``)."""
    per_word = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, per_word)[..., list(order or range(per_word))]   # [..., words, per_word]
    words = (v << (bits * torch.arange(per_word))).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)                      # as int32 bits
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def _min_max_codes(w_t: torch.Tensor, groups: torch.Tensor, num_groups: int, zero_lo: int):
    """w_t [in, out], groups [in] -> codes [in, out], scales [G, out] (float16), zeros [G, out]."""
    scales = torch.empty(num_groups, w_t.shape[1], dtype=torch.float16)
    zeros = torch.empty(num_groups, w_t.shape[1], dtype=torch.int64)
    for g in range(num_groups):
        rows = w_t[groups == g]
        lo, hi = rows.min(0).values.clamp(max=0), rows.max(0).values.clamp(min=0)
        scales[g] = ((hi - lo) / (15 - zero_lo)).clamp(min=1e-6).half()
        zeros[g] = (zero_lo - torch.round(lo / scales[g].float())).clamp(zero_lo, 15).long()
    s, z = scales.float()[groups], zeros[groups]
    codes = (torch.round(w_t / s) + z).clamp(0, 15).long()
    return codes, scales, zeros


def gptq_tensors(weight: torch.Tensor, group: int, desc_act: bool, v2: bool, seed: int):
    """weight [out, in] -> ({qweight, qzeros, scales, g_idx}, dequantized weight [out, in])."""
    w_t = weight.t().float()
    rows = w_t.shape[0]
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed)) if desc_act else torch.arange(rows)
    g_idx = torch.empty(rows, dtype=torch.int32)
    g_idx[order] = (torch.arange(rows) // group).to(torch.int32)
    codes, scales, zeros = _min_max_codes(w_t, g_idx.long(), rows // group, 0 if v2 else 1)
    dequant = (codes - zeros[g_idx.long()]).float() * scales.float()[g_idx.long()]
    tensors = {"qweight": pack_words(codes, 0), "qzeros": pack_words(zeros - (0 if v2 else 1), 1), "scales": scales,
               "g_idx": g_idx}
    return tensors, dequant.t().contiguous()


def awq_tensors(weight: torch.Tensor, group: int):
    w_t = weight.t().float()
    groups = torch.arange(w_t.shape[0]) // group
    codes, scales, zeros = _min_max_codes(w_t, groups, w_t.shape[0] // group, 0)
    dequant = (codes - zeros[groups]).float() * scales.float()[groups]
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    tensors = {"qweight": pack_words(codes, 1, order=order), "qzeros": pack_words(zeros, 1, order=order),
               "scales": scales}
    return tensors, dequant.t().contiguous()


def fp8_tensors(weight: torch.Tensor, block: int | None):
    w = weight.float()
    if block is None:
        scale = w.abs().amax(1, keepdim=True) / 448.0                               # [out, 1]
        codes = (w / scale).to(torch.float8_e4m3fn)
        return {"weight": codes, "weight_scale": scale}, codes.float() * scale
    out, inp = w.shape
    scale = torch.empty(-(-out // block), -(-inp // block))
    full = torch.empty_like(w)
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            tile = w[r * block:(r + 1) * block, c * block:(c + 1) * block]
            scale[r, c] = tile.abs().max() / 448.0
            full[r * block:(r + 1) * block, c * block:(c + 1) * block] = scale[r, c]
    codes = (w / full).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale_inv": scale}, codes.float() * full


def quantize_folder(source: str, quantized: Path, dequantized: Path, fmt: str, **kwargs) -> None:
    """source model folder -> ``quantized`` (the format's tensors, config with quantization_config) and
    ``dequantized`` (the same model with the dequantized weights, a plain checkpoint)."""
    for folder in (quantized, dequantized):
        shutil.copytree(source, folder)
        for file in folder.glob("*.safetensors"):
            file.unlink()
    tensors = {}
    for file in Path(source).glob("*.safetensors"):
        tensors.update(load_file(str(file)))
    packed, plain = {}, {}
    for index, (name, value) in enumerate(sorted(tensors.items())):
        module = name.rsplit(".", 2)
        if len(module) == 3 and module[1] in LINEARS and module[2] == "weight":
            prefix = name[: -len(".weight")]
            if fmt == "gptq":
                parts, dequant = gptq_tensors(value, kwargs["group"], kwargs["desc_act"], kwargs["v2"], index)
            elif fmt == "awq":
                parts, dequant = awq_tensors(value, kwargs["group"])
            else:
                parts, dequant = fp8_tensors(value, kwargs.get("block"))
            packed.update({f"{prefix}.{k}": v.contiguous() for k, v in parts.items()})
            plain[name] = dequant.to(value.dtype)
        else:
            packed[name] = plain[name] = value
    save_file(packed, str(quantized / "model.safetensors"))
    save_file(plain, str(dequantized / "model.safetensors"))
    config = json.loads((quantized / "config.json").read_text())
    if fmt == "gptq":
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": kwargs["group"],
                                         "desc_act": kwargs["desc_act"], "sym": False,
                                         "checkpoint_format": "gptq_v2" if kwargs["v2"] else "gptq"}
    elif fmt == "awq":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": kwargs["group"],
                                         "zero_point": True, "version": "gemm"}
    elif kwargs.get("compressed_tensors"):           # llm-compressor's FP8 (per output channel, dynamic inputs)
        weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
        config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                         "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
                                         "ignore": ["lm_head"]}
    else:
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
        if kwargs.get("block"):
            config["quantization_config"]["weight_block_size"] = [kwargs["block"], kwargs["block"]]
    (quantized / "config.json").write_text(json.dumps(config))


def round_rows_8bit(source: str, dequantized: Path, method: str) -> None:
    """What ``quantization`` int8 / fp8 should compute from a full-precision folder, written as a plain one:
    every decoder linear weight rounded with one symmetric scale per output row."""
    shutil.copytree(source, dequantized)
    tensors = {}
    for file in Path(source).glob("*.safetensors"):
        tensors.update(load_file(str(file)))
        (dequantized / file.name).unlink()
    qmax = 127.0 if method == "int8" else 448.0
    for name, value in tensors.items():
        module = name.rsplit(".", 2)
        if len(module) == 3 and module[1] in LINEARS and module[2] == "weight":
            w = value.float()
            scale = w.abs().amax(1, keepdim=True) / qmax
            q = torch.round(w / scale).clamp(-127, 127) if method == "int8" else (w / scale).to(torch.float8_e4m3fn)
            tensors[name] = (q.float() * scale).to(value.dtype)
    save_file(tensors, str(dequantized / "model.safetensors"))
