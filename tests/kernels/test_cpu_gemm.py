"""The bfloat16 CPU GEMM in C (``kernels/cpu_gemm.c``) against a float64 product on random inputs:
every row count the kernel treats differently (1..16 rows in one pass, blocks of 12 over tile pairs,
their tails), output widths that end inside a tile, bias, 1 and 2 threads, strided and 3-D inputs; the
packed layout element by element; the argument checks; the layer's choice between it and oneDNN."""

from __future__ import annotations

import pytest
import torch
from pagedray.kernels import cpu_gemm
from pagedray.workers.layers import packed_gemm

needs_gemm = pytest.mark.skipif(not cpu_gemm.available(), reason="this CPU or compiler has no AVX512-BF16")


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def torch_threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _assert_product(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """y (bf16) is the float64 product rounded once to bf16, up to float32 summation error: each element
    within half a bf16 step of the exact value plus k float32 roundings of |x| @ |w|^T; and 99% of
    the elements are exactly the rounded exact value (a layout or pairing mistake moves far more)."""
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())     # [rows, out]
    k = x.shape[-1]
    bound = exact.abs() * 2 ** -8 + k * 2 ** -23 * (x.double().abs() @ weight.double().abs().T) + 1e-30
    assert y.dtype == torch.bfloat16 and y.shape == exact.shape
    assert ((y.double() - exact).abs() <= bound).all()
    assert (y == exact.to(torch.bfloat16)).double().mean() >= 0.99


@needs_gemm
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (251, 64), (40, 2), (3, 30)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_product_matches_float64(out_features, in_features, with_bias, torch_threads):
    gen = torch.Generator().manual_seed(out_features * 7 + in_features)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).bfloat16()   # [out, in]
    bias = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None    # [out]
    packed = cpu_gemm.pack_bf16(weight)
    for rows in (1, 2, 7, 15, 16, 17, 24, 25, 36, 100):
        x = torch.randn(rows, in_features, generator=gen).bfloat16()                    # [rows, in]
        _assert_product(cpu_gemm.linear_bf16(x, packed, bias), x, weight, bias)


@needs_gemm
def test_strided_3d_and_misaligned_inputs():
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(70, 96, generator=gen) * 0.1).bfloat16()
    packed = cpu_gemm.pack_bf16(weight)
    wide = torch.randn(19, 2 * 96 + 1, generator=gen).bfloat16()
    for x in (wide[:, :96], wide[:, 1:97], wide[:, ::2][:, :96]):           # row stride, odd offset, column stride
        _assert_product(cpu_gemm.linear_bf16(x, packed), x, weight, None)
    x = torch.randn(2, 5, 96, generator=gen).bfloat16()                      # [batch, tokens, in]
    y = cpu_gemm.linear_bf16(x, packed)
    assert y.shape == (2, 5, 70)
    _assert_product(y.reshape(10, 70), x.reshape(10, 96), weight, None)
    assert cpu_gemm.linear_bf16(torch.empty(0, 96, dtype=torch.bfloat16), packed).shape == (0, 70)


@needs_gemm
def test_packed_layout_pairs_inputs_per_sixteen_outputs():
    weight = torch.arange(20 * 6, dtype=torch.float32).reshape(20, 6).bfloat16()   # exact in bf16
    packed = cpu_gemm.pack_bf16(weight)
    assert packed.data.shape == (2, 3, 16, 2) and (packed.out_features, packed.in_features) == (20, 6)
    for t in range(2):
        for j in range(3):
            for c in range(16):
                for e in range(2):
                    row = 16 * t + c
                    expected = weight[row, 2 * j + e] if row < 20 else 0
                    assert packed.data[t, j, c, e] == expected


@needs_gemm
def test_bad_arguments_are_named():
    weight = torch.randn(8, 6).bfloat16()
    packed = cpu_gemm.pack_bf16(weight)
    with pytest.raises(ValueError, match="^weight"):
        cpu_gemm.pack_bf16(torch.randn(8, 5).bfloat16())           # odd number of inputs
    with pytest.raises(ValueError, match="^weight"):
        cpu_gemm.pack_bf16(torch.randn(8, 6))                      # float32
    with pytest.raises(ValueError, match="^x"):
        cpu_gemm.linear_bf16(torch.randn(2, 6), packed)
    with pytest.raises(ValueError, match="^x: last dimension 4"):
        cpu_gemm.linear_bf16(torch.randn(2, 4).bfloat16(), packed)
    with pytest.raises(ValueError, match="^bias"):
        cpu_gemm.linear_bf16(torch.randn(2, 6).bfloat16(), packed, torch.randn(7).bfloat16())
    with pytest.raises(ValueError, match="^packed"):
        cpu_gemm.linear_bf16(torch.randn(2, 6).bfloat16(), weight)


@needs_gemm
def test_layers_pair_pack_bf16_and_keep_onednn_for_fp32(monkeypatch):
    weight = torch.randn(48, 32)
    assert isinstance(packed_gemm.pack_weight(weight.bfloat16()), cpu_gemm.PairPackedWeight)
    assert isinstance(packed_gemm.pack_weight(weight), torch.Tensor)                      # oneDNN's copy
    assert isinstance(packed_gemm.pack_weight(torch.randn(48, 33).bfloat16()), torch.Tensor)   # odd inputs
    x = torch.randn(5, 32).bfloat16()
    _assert_product(packed_gemm.linear(x, weight.bfloat16(), None, packed_gemm.pack_weight(weight.bfloat16())),
                    x, weight.bfloat16(), None)
    monkeypatch.setattr(cpu_gemm, "available", lambda: False)                             # no AVX512-BF16
    assert isinstance(packed_gemm.pack_weight(weight.bfloat16()), torch.Tensor)
