"""``kernels.fused_moe``: the Triton grouped-GEMM kernel (``moe_triton``, run by the interpreter on CPU) against
the torch loop over experts (``fused_moe_reference``, the CPU path and transformers' order) on random
inputs: odd expert counts, top-k 1 / 2 / 8, experts that get no token, float32 and float16, token counts
that do not fill a row block; plus the row alignment itself and the argument checks."""

from __future__ import annotations

import pytest
import torch
from helpers.paged_kv_cases import kernel_device, seed_of
from pagedray import kernels
from pagedray.kernels.triton.moe_triton import align_by_expert


def _case(tokens, experts, top_k, hidden, inter, dtype, seed, only=None):
    gen = torch.Generator().manual_seed(seed)
    device = kernel_device()
    x = (torch.randn(tokens, hidden, generator=gen) * 0.5).to(dtype).to(device)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2).to(dtype).to(device)
    down = (torch.randn(experts, hidden, inter, generator=gen) * 0.2).to(dtype).to(device)
    logits = torch.randn(tokens, experts, generator=gen)
    if only is not None:                       # route only to these experts: the others get no token
        mask = torch.full((experts,), float("-inf"))
        mask[only] = 0.0
        logits = logits + mask
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return x, gate_up, down, weights.to(dtype).to(device), ids.to(device)


@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, dtype, only, activation", [
    (7, 5, 2, 32, 48, torch.float32, None, "silu"),
    (13, 7, 1, 64, 32, torch.float32, None, "silu"),
    (3, 9, 8, 32, 16, torch.float32, None, "silu"),
    (20, 6, 2, 32, 32, torch.float16, [1, 4], "silu"),     # four experts get no token
    (70, 4, 2, 16, 16, torch.float32, None, "silu"),       # past 64 tokens: the larger row blocks
    (9, 4, 2, 32, 16, torch.float32, None, "gelu_tanh"),   # Gemma 4's experts
])
def test_triton_matches_the_loop_over_experts(tokens, experts, top_k, hidden, inter, dtype, only, activation):
    case = _case(tokens, experts, top_k, hidden, inter, dtype, seed_of("moe", tokens, experts, top_k), only)
    want = kernels.fused_moe(*case, activation=activation, use_triton=False)
    got = kernels.fused_moe(*case, activation=activation, use_triton=True)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=tolerance)
    assert want.abs().max() > 0.01                  # a real output, not zeros
    other = kernels.fused_moe(*case, activation="silu" if activation != "silu" else "gelu_tanh", use_triton=False)
    assert not torch.allclose(other, want, rtol=0, atol=tolerance)   # the activation is the one asked for


@pytest.mark.parametrize("tokens, dtype", [(11, torch.float32), (70, torch.float32), (9, torch.float16)])
def test_biased_experts_with_the_clamped_swiglu_match_a_float64_loop(tokens, dtype):
    """gpt-oss's experts (biases on both products, ``ClampedSwiglu`` with a limit the gates and ups reach): the
    Triton kernels (interpreter) and the torch loop against a float64 per-token sum; a missing bias would show."""
    experts, top_k, hidden, inter = 5, 2, 32, 16
    x, gate_up, down, weights, ids = _case(tokens, experts, top_k, hidden, inter, dtype, seed_of("moe-b", tokens))
    gen = torch.Generator().manual_seed(tokens)
    x = x * 6                                                      # gate_up values beyond the limit of 1.5
    gate_up_bias = torch.randn(experts, 2 * inter, generator=gen).to(dtype).to(x.device)
    down_bias = torch.randn(experts, hidden, generator=gen).to(dtype).to(x.device)
    act = kernels.ClampedSwiglu(limit=1.5, alpha=1.702)
    want = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for slot in range(top_k):
            e = int(ids[t, slot])
            h = gate_up[e].double() @ x[t].double() + gate_up_bias[e].double()
            gate, up = h[:inter].clamp(max=1.5), h[inter:].clamp(-1.5, 1.5)
            y = down[e].double() @ ((up + 1) * gate * torch.sigmoid(1.702 * gate)) + down_bias[e].double()
            want[t] += weights[t, slot].double() * y
    assert (gate_up[ids[0, 0]].double() @ x[0].double()).abs().max() > 1.5        # the clamps bite
    tolerance = 2e-4 if dtype == torch.float32 else 6e-2
    for use_triton in (False, True):
        got = kernels.fused_moe(x, gate_up, down, weights, ids, activation=act, gate_up_bias=gate_up_bias,
                                down_bias=down_bias, use_triton=use_triton)
        torch.testing.assert_close(got.double().cpu(), want, rtol=0, atol=tolerance * float(want.abs().max()))
    with pytest.raises(ValueError, match="gate_up_bias"):
        kernels.fused_moe(x, gate_up, down, weights, ids, activation=act, gate_up_bias=gate_up_bias[:, :inter])
    with pytest.raises(ValueError, match="down_bias"):
        kernels.fused_moe(x, gate_up, down, weights, ids, activation=act, down_bias=down_bias.double())


def test_rows_are_grouped_by_expert_and_padded():
    ids = torch.tensor([[3, 0], [0, 2], [3, 0]])                     # rows 0..5 = token * 2 + slot
    rows, experts = align_by_expert(ids, num_experts=5, block_m=4)
    # experts 1 and 4 get no block; the worst-case length 6 + 5 * 3 -> 24 rows leaves 3 unused blocks (-1)
    assert experts.tolist() == [0, 2, 3, -1, -1, -1]
    assert rows.tolist() == [1, 2, 5, 6, 3, 6, 6, 6, 0, 4, 6, 6] + [6] * 12   # 6 = the sentinel (tokens * top_k)


@pytest.mark.parametrize("change, message", [
    (lambda c: (c[0], c[1], c[2][:, :, :3], c[3], c[4]), "gate_up / down: shapes"),
    (lambda c: (c[0], c[1], c[2], c[3], c[4] + 10), "topk_ids: expert ids must lie in"),
    (lambda c: (c[0], c[1], c[2], c[3].double(), c[4]), "topk_weights: expected"),
    (lambda c: (c[0], c[1].half(), c[2], c[3], c[4]), "gate_up: dtype"),
])
def test_bad_arguments_are_value_errors_naming_them(change, message):
    case = _case(5, 4, 2, 16, 16, torch.float32, 1)
    with pytest.raises(ValueError, match=message):
        kernels.fused_moe(*change(case))
    with pytest.raises(ValueError, match="activation: expected one of"):
        kernels.fused_moe(*case, activation="relu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("tokens", [3, 300])
def test_triton_matches_the_loop_over_experts_at_model_size_gpu(tokens, dtype, tolerance):
    """Qwen3-MoE-like widths on CUDA; fp32 must use IEEE products (TF32 misses 1e-4 at these widths)."""
    case = _case(tokens, 16, 4, 1024, 384, dtype, seed_of("moe-gpu", tokens))
    want = kernels.fused_moe(*case, use_triton=False)
    got = kernels.fused_moe(*case, use_triton=True)
    scale = want.float().abs().max()
    assert scale > 0.1
    torch.testing.assert_close(got.float() / scale, want.float() / scale, rtol=0, atol=tolerance)
