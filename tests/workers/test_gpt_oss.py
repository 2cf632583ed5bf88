"""gpt-oss specifics beyond the family runs (test_worker_greedy, test_families_engine, test_worker_tp): an MXFP4
checkpoint, its dequantizer against transformers', YaRN's frequencies against transformers', and the checks
that refuse configs this model cannot run."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_oracle import hf_greedy_each
from helpers.mxfp4_checkpoints import mxfp4_checkpoint
from helpers.worker_setup import local_driver
from pagedray.workers.layers.rotary import RotaryEmbedding, rope_parameters
from pagedray.workers.weights.quantization import dequantize_mxfp4

PROMPTS = [[5, 17, 33, 8, 99, 120, 7], list(range(3, 40))]


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


def test_an_mxfp4_checkpoint_matches_transformers_on_its_dequantized_weights(tmp_path):
    packed, plain = mxfp4_checkpoint(tmp_path)
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


@pytest.mark.parametrize("use_triton", [False, True])
def test_mxfp4_experts_kept_in_4_bits_in_the_fused_layout_match_transformers(use_triton, tmp_path, monkeypatch):
    """CUDA's layout for an MXFP4 checkpoint, built on CPU: the experts stay 4-bit (float4 ``PackedExperts``: the
    checkpoint's e2m1 codes and scales, no 16-bit copy), through the packed grouped GEMM under the interpreter
    and through its dequantized reference; transformers' tokens on its own dequantized weights."""
    from pagedray.workers.layers import clamped_moe

    monkeypatch.setattr(clamped_moe, "fused_triton_path", lambda device: True)
    packed, plain = mxfp4_checkpoint(tmp_path)
    worker, driver = local_driver(packed, token_budget=24, max_chunk=16)
    moes = [layer.mlp for layer in worker.model.layers]
    assert all(moe.packed is not None and moe.gate_up is None for moe in moes) and worker.model.graph_safe
    gate_up, down = moes[0].packed
    assert gate_up.float4 and gate_up.bits == 4 and gate_up.group_size == 32 and down.float4
    for moe in moes:
        moe.use_triton = use_triton
    assert driver.generate(PROMPTS, 24) == hf_greedy_each(plain, PROMPTS, 24)
