"""``kernels.fused_moe`` over packed experts (``quant_gemm.PackedExperts``: 4-bit groups, 8-bit codes with zero
points, float8 codes, MXFP4's float4 e2m1 codes with power-of-two scales): the Triton kernel
(``_grouped_packed_gemm_kernel``, the interpreter on CPU) against the loop over experts on the dequantized weights,
and the reference path against the same loop on weights dequantized by hand from the codes (not through
``dequantize_packed``). Groups that fill a K slice (one row of scales per slice) and groups that do not (each
row's group read); experts that get no token."""

from __future__ import annotations

import pytest
import torch
from helpers.paged_kv_cases import kernel_device, seed_of
from helpers.quantized_checkpoints import pack_words
from pagedray import kernels
from pagedray.kernels.quant_gemm import PackedExperts
from pagedray.kernels.triton import moe_triton

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]   # OCP MX spec


def _packed(experts: int, n: int, k: int, bits: int, group: int, float8: bool, gen, float4: bool = False):
    """Random packed experts of weight [E, N, K] -> (PackedExperts on the kernel device, float32 [E, N, K] built
    from the codes directly)."""
    top = (1 << bits) - 1
    codes = torch.randint(0, top + 1, (experts, k, n), generator=gen)
    if float8:
        codes = torch.where(codes & 0x7F == 0x7F, codes - 1, codes)                        # no NaN
    groups = -(-k // group)
    zeros = torch.randint(0, top + 1, (experts, groups, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(experts, groups, n, generator=gen) * 0.02 + 0.002).half()
    g_idx = torch.arange(k) // group
    if float4:                                   # MXFP4: power-of-two scales, the zero points never read
        scales = torch.exp2(torch.randint(-7, -3, (experts, groups, n), generator=gen).float())
        values = torch.tensor(E2M1)[codes]
    elif float8:
        values = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()
    else:
        values = (codes - zeros[:, g_idx]).float()
    dense = (values * scales.float()[:, g_idx]).transpose(1, 2).contiguous()                  # [E, N, K]
    qweight = torch.stack([pack_words(c, 0, bits) for c in codes])
    device = kernel_device()
    packed = PackedExperts(qweight.to(device), zeros.to(device), scales.to(device), g_idx.to(torch.int32).to(device),
                           bits, group, float8, float4)
    return packed, dense


@pytest.mark.parametrize("bits, group, float8, hidden, inter, float4", [
    (4, 32, False, 64, 48, False),   # groups smaller than a K slice (128 rows): each row's group
    (4, 128, False, 128, 128, False),   # one group per K slice
    (8, 64, False, 64, 64, False),   # 8-bit codes, one group per K slice (64 rows)
    (8, 64, True, 64, 32, False),    # float8 codes, per-channel-like groups
    (4, 32, False, 64, 96, True),    # MXFP4: e2m1 codes in groups of 32
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("wide", [False, True])
def test_packed_experts_match_the_loop_on_their_dequantized_weights(bits, group, float8, hidden, inter, float4, dtype,
                                                                     wide, monkeypatch):
    """``wide``: each K slice unpacked in row order for one product (the large-row-block form), else one
    product per position in the word."""
    config = moe_triton.moe_config
    monkeypatch.setattr(moe_triton, "moe_config", lambda tokens, packed: {**config(tokens, packed), "WIDE": wide})
    gen = torch.Generator().manual_seed(seed_of("moe-packed", bits, group, float8, float4, str(dtype)))
    experts, tokens, top_k = 5, 11, 2
    gate_up, gate_up_dense = _packed(experts, 2 * inter, hidden, bits, min(group, hidden), float8, gen, float4)
    down, down_dense = _packed(experts, hidden, inter, bits, min(group, inter), float8, gen, float4)
    device = kernel_device()
    x = (torch.randn(tokens, hidden, generator=gen) * 0.5).to(dtype).to(device)
    logits = torch.randn(tokens, experts, generator=gen) + torch.tensor([0, 0, float("-inf"), 0, 0])  # expert 2: none
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    weights, ids = weights.to(dtype).to(device), ids.to(device)
    want = kernels.fused_moe(x, gate_up_dense.to(dtype).to(device), down_dense.to(dtype).to(device), weights, ids,
                             use_triton=False).float()
    assert want.abs().max() > 0.01
    tolerance = (1e-4 if dtype == torch.float32 else 2e-2) * want.abs().max().item()
    for use_triton in (False, True):
        got = kernels.fused_moe(x, gate_up, down, weights, ids, use_triton=use_triton)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, rtol=0, atol=tolerance)


def test_packed_and_dense_experts_do_not_mix_and_bad_packs_are_named():
    gen = torch.Generator().manual_seed(3)
    gate_up, dense = _packed(3, 32, 16, 8, 16, False, gen)
    down, _ = _packed(3, 16, 16, 8, 16, False, gen)
    x = torch.randn(4, 16).to(kernel_device())
    ids = torch.zeros(4, 1, dtype=torch.int64, device=x.device)
    weights = torch.ones(4, 1, device=x.device)
    with pytest.raises(ValueError, match="down: expected a PackedExperts"):
        kernels.fused_moe(x, gate_up, dense.to(x.device), weights, ids)
    bad = PackedExperts(gate_up.qweight, gate_up.zeros, gate_up.scales, gate_up.g_idx, 8, 5)
    with pytest.raises(ValueError, match="gate_up: inconsistent packed experts"):
        kernels.fused_moe(x, bad, down, weights, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("bits, group, float8, float4", [(4, 128, False, False), (8, 512, False, False),
                                                         (8, 512, True, False), (4, 32, False, True)])
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_packed_experts_on_cuda_match_the_loop(bits, group, float8, float4, tokens):
    """bf16 at a Qwen3-MoE-like width (16 experts, top-8, H 512, I 256): decode and prefill row blocks; MXFP4's
    float4 codes in groups of 32 among them."""
    gen = torch.Generator().manual_seed(seed_of("moe-packed-gpu", bits, float8, float4, tokens))
    gate_up, gate_up_dense = _packed(16, 512, 512, bits, group, float8, gen, float4)
    down, down_dense = _packed(16, 512, 256, bits, min(group, 256), float8, gen, float4)
    x = (torch.randn(tokens, 512, generator=gen) * 0.5).bfloat16().cuda()
    weights, ids = torch.topk(torch.randn(tokens, 16, generator=gen).softmax(-1), 8, dim=-1)
    weights, ids = weights.bfloat16().cuda(), ids.cuda()
    want = kernels.fused_moe(x.float(), gate_up_dense.cuda(), down_dense.cuda(), weights.float(), ids,
                             use_triton=False)
    got = kernels.fused_moe(x, gate_up, down, weights, ids)
    torch.testing.assert_close(got.float(), want, rtol=0, atol=3e-2 * want.abs().max().item())
