"""LongRoPE (``layers/rotary.py``): the inverse frequencies and the cos / sin scale equal transformers' own
``_compute_longrope_parameters`` for the factors pagedray picks (short when ``max_model_len`` is at most
the original length, long beyond it), on a Phi-3-128k-shaped config; the torch path's cos / sin carry the
scale as transformers applies it. (The HF-exact greedy run is ``phi3-longrope`` in test_worker_greedy.py.)"""

import pytest
import torch
from pagedray.workers.layers.rotary import RotaryEmbedding, rope_parameters


def _phi3_128k():
    from transformers import Phi3Config

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
            "short_factor": [1.0 + 0.01 * i for i in range(48)], "long_factor": [1.1 + 0.7 * i for i in range(48)],
            "original_max_position_embeddings": 4096}
    return Phi3Config(hidden_size=3072, num_attention_heads=32, max_position_embeddings=131072,
                      original_max_position_embeddings=4096, rope_parameters=rope, pad_token_id=0)


@pytest.mark.parametrize("max_model_len, hf_seq_len", [(4096, None), (2048, 100), (8192, 4097), (131072, 100_000)])
def test_factors_and_scale_equal_transformers(max_model_len, hf_seq_len):
    from transformers.modeling_rope_utils import _compute_longrope_parameters

    config = _phi3_128k()
    want_inv_freq, want_scale = _compute_longrope_parameters(config, torch.device("cpu"), seq_len=hf_seq_len)
    rotary = RotaryEmbedding(96, rope_parameters(config), torch.device("cpu"), max_model_len)
    assert torch.equal(rotary.inv_freq, want_inv_freq)
    assert rotary.scale == pytest.approx(want_scale, rel=1e-12) and rotary.scale > 1.0


def test_the_torch_paths_cos_sin_carry_the_scale():
    rotary = RotaryEmbedding(96, rope_parameters(_phi3_128k()), torch.device("cpu"), 4096)
    positions = torch.tensor([0, 5, 4095])
    cos, signed_sin = rotary.cos_sin(positions, torch.float32)
    angles = positions.float()[:, None] * rotary.inv_freq
    torch.testing.assert_close(cos[:, 0, :48], angles.cos() * rotary.scale, rtol=0, atol=0)
    torch.testing.assert_close(signed_sin[:, 0, 48:], angles.sin() * rotary.scale, rtol=0, atol=0)


def test_factor_lists_of_the_wrong_length_are_a_value_error():
    params = rope_parameters(_phi3_128k())
    with pytest.raises(ValueError, match="short_factor has 48 entries, expected head_dim / 2 = 32"):
        RotaryEmbedding(64, params, torch.device("cpu"), 4096)
