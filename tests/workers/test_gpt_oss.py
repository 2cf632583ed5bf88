"""gpt-oss specifics beyond the family runs (test_worker_greedy, test_families_engine, test_worker_tp): an MXFP4
checkpoint, its dequantizer against transformers', YaRN's frequencies against transformers', and the checks
that refuse configs this model cannot run."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.hf_oracle import hf_greedy_each
from helpers.tiny_models import tiny_config
from helpers.worker_setup import local_driver
from pagedray.workers.layers.rotary import RotaryEmbedding, rope_parameters
from pagedray.workers.weights.quantization import FP4_E2M1_VALUES, dequantize_mxfp4

PROMPTS = [[5, 17, 33, 8, 99, 120, 7], list(range(3, 40))]


def _to_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


def test_dequantize_mxfp4_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(67)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 10, 4), generator=gen, dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        assert torch.equal(dequantize_mxfp4(blocks, scales, dtype), want)
    with pytest.raises(ValueError, match="MXFP4"):
        dequantize_mxfp4(blocks, scales[..., :3], torch.float32)


def _mxfp4_checkpoint(tmp_path) -> tuple[str, str]:
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
                blocks, scales = _to_mxfp4(param)
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


def test_an_mxfp4_checkpoint_matches_transformers_on_its_dequantized_weights(tmp_path):
    packed, plain = _mxfp4_checkpoint(tmp_path)
    from safetensors import safe_open

    with safe_open(f"{packed}/model.safetensors", "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in f.keys()
        assert "model.layers.0.mlp.experts.gate_up_proj" not in f.keys()
    _, driver = local_driver(packed, token_budget=24, max_chunk=16)
    assert driver.generate(PROMPTS, 64) == hf_greedy_each(plain, PROMPTS, 64)


@pytest.mark.parametrize("params", [
    {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
     "original_max_position_embeddings": 4096, "rope_theta": 150_000.0},                     # gpt-oss's own
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "rope_theta": 10_000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 10_000.0,
     "mscale": 1.0, "mscale_all_dim": 0.5},
])
def test_yarn_frequencies_and_factor_equal_transformers(params):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = GptOssConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          rope_parameters=dict(params))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    rotary = RotaryEmbedding(16, rope_parameters(config), torch.device("cpu"))
    assert torch.equal(rotary.inv_freq, inv_freq) and rotary.scale == pytest.approx(factor, rel=0, abs=0)
    assert not torch.equal(inv_freq, RotaryEmbedding(16, {**params, "rope_type": "default"},
                                                     torch.device("cpu")).inv_freq)


def test_yarn_without_its_factor_is_refused():
    with pytest.raises(ValueError, match="yarn"):
        RotaryEmbedding(16, {"rope_type": "yarn", "rope_theta": 10_000.0}, torch.device("cpu"))


@pytest.mark.parametrize("use_triton", [False, True])
def test_the_fused_expert_layout_of_cuda_matches_transformers(use_triton, tiny_model_path, monkeypatch):
    """The layout and call CUDA runs (``ClampedSwigluMoE.fused``: experts rearranged gates-first at load, one
    ``kernels.fused_moe`` call with the biases and the clamped SwiGLU, no host reads: graph-safe), built on CPU;
    the torch loop over experts and the grouped Triton GEMMs under the interpreter give transformers' tokens."""
    from pagedray.workers.layers import clamped_moe

    monkeypatch.setattr(clamped_moe, "fused_triton_path", lambda device: True)
    path = tiny_model_path("gpt-oss")
    worker, driver = local_driver(path, token_budget=24, max_chunk=16)
    moes = [layer.mlp for layer in worker.model.layers]
    assert all(moe.fused for moe in moes) and worker.model.graph_safe
    for moe in moes:
        moe.use_triton = use_triton
    assert driver.generate(PROMPTS, 24) == hf_greedy_each(path, PROMPTS, 24)


def test_the_loop_layout_of_cpu_is_not_graph_safe(tiny_model_path):
    worker, _ = local_driver(tiny_model_path("gpt-oss"))
    assert not any(layer.mlp.fused for layer in worker.model.layers) and not worker.model.graph_safe
