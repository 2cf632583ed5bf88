"""The AMX bfloat16 product (``kernels/cpu/cpu_amx.c``) on the C GEMM's tile-packed weights, against a float64
product on random inputs: row counts below, at and past one 16-row block (the last block of m > 16 overlaps
the one before it), output widths that end inside a tile and inside a group of four tiles, bias, 1 and 2
threads, strided and 3-D inputs; each row's bits the same in any block; the fused gate/up + SiLU * up pass
bit for bit the product then ``cpu_fused``'s SiLU * up; the argument checks (also on a CPU without AMX)."""

from __future__ import annotations

import pytest
import torch
from pagedray.kernels.cpu import cpu_amx, cpu_fused, cpu_gemm
from test_cpu_gemm import _assert_product

BF16 = torch.bfloat16
needs_bf16 = pytest.mark.skipif(not cpu_gemm.available(BF16), reason="this CPU or compiler has no AVX512-BF16")
needs_amx = pytest.mark.skipif(not cpu_amx.available(), reason="this CPU, its kernel or the compiler has no AMX-BF16")
ROWS = (1, 2, 7, 15, 16, 17, 20, 31, 32, 33, 47, 100)


def _weight(out_features: int, in_features: int, seed: int) -> tuple[torch.Generator, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(BF16)     # [out, in]
    return gen, weight, torch.randn(out_features, generator=gen).to(BF16)               # bias [out]


@needs_amx
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (251, 64), (40, 32), (3, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_product_matches_float64(out_features, in_features, with_bias, torch_threads):
    gen, weight, bias = _weight(out_features, in_features, out_features * 7 + in_features)
    bias = bias if with_bias else None
    packed = cpu_gemm.pack(weight)
    for rows in ROWS:
        x = torch.randn(rows, in_features, generator=gen).to(BF16)                     # [rows, in]
        _assert_product(cpu_amx.linear(x, packed, bias), x, weight, bias)


@needs_amx
def test_each_row_gets_the_bits_it_gets_alone(torch_threads):
    """A row's sums do not depend on its block (the overlapping last block included): every row of a product
    of 2..50 strided rows equals, bit for bit, that row multiplied alone."""
    gen, weight, bias = _weight(83, 160, 11)                                       # a partial tile and group
    packed = cpu_gemm.pack(weight)
    wide = torch.randn(50, 2 * 160, generator=gen).to(BF16)
    for rows in (2, 16, 17, 29, 32, 50):
        x = wide[:rows, 2:162]                                                       # [rows, in], row stride 320
        y = cpu_amx.linear(x, packed, bias)
        alone = torch.cat([cpu_amx.linear(x[i:i + 1], packed, bias) for i in range(rows)])
        assert torch.equal(y, alone), rows
        _assert_product(y, x, weight, bias)


@needs_amx
def test_three_d_input_keeps_its_leading_shape():
    gen, weight, bias = _weight(48, 64, 3)
    x = torch.randn(2, 9, 64, generator=gen).to(BF16)                                # [batch, tokens, in]
    y = cpu_amx.linear(x, cpu_gemm.pack(weight), bias)
    assert y.shape == (2, 9, 48)
    _assert_product(y.reshape(18, 48), x.reshape(18, 64), weight, bias)


@needs_amx
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("inter", [48, 64])     # 3 tile pairs (a last task of one pair), 4
def test_fused_pass_has_the_bits_of_the_product_then_silu(inter, with_bias, torch_threads):
    gen, weight, bias = _weight(2 * inter, 96, inter)
    bias = bias if with_bias else None
    packed = cpu_gemm.pack(weight)
    wide = torch.randn(40, 2 * 96, generator=gen).to(BF16)
    for rows in (1, 5, 16, 17, 40):
        x = wide[:rows, 7:103]                                                       # [rows, 96], row stride 192
        want = cpu_fused.silu_and_mul_cpu(cpu_amx.linear(x, packed, bias))          # [rows, inter]
        assert torch.equal(cpu_amx.silu_mul_linear(x, packed, bias), want), rows


@needs_amx
def test_close_to_the_c_gemm():
    """Both sum in k order in float32 (each pair as its instruction adds it): the same bits almost everywhere."""
    gen, weight, bias = _weight(960, 576, 5)
    packed = cpu_gemm.pack(weight)
    x = torch.randn(40, 576, generator=gen).to(BF16)
    same = (cpu_amx.linear(x, packed, bias) == cpu_gemm.linear(x, packed, bias)).double().mean()
    assert same >= 0.99


@needs_bf16
def test_bad_arguments_are_value_errors_naming_them():
    gen, weight, _ = _weight(32, 48, 1)                      # 48 input features: not whole tile products
    packed = cpu_gemm.pack(weight)
    with pytest.raises(ValueError, match="packed: the AMX product takes .* multiple of 32"):
        cpu_amx.linear(torch.randn(2, 48).to(BF16), packed)
    packed64 = cpu_gemm.pack(_weight(32, 64, 2)[1])
    with pytest.raises(ValueError, match="x: expected a torch.bfloat16"):
        cpu_amx.linear(torch.randn(2, 64), packed64)
    with pytest.raises(ValueError, match="x: last dimension 32"):
        cpu_amx.linear(torch.randn(2, 32).to(BF16), packed64)
    with pytest.raises(ValueError, match="packed: a fused gate/up product"):
        cpu_amx.silu_mul_linear(torch.randn(2, 64).to(BF16), cpu_gemm.pack(_weight(40, 64, 3)[1]))
    assert not cpu_amx.takes(weight) and not cpu_amx.takes(weight.float())


@needs_bf16
@pytest.mark.skipif(cpu_amx.available(), reason="this CPU has AMX")
def test_without_amx_nothing_takes_it_and_a_call_is_a_value_error():
    _, weight, _ = _weight(32, 64, 4)
    assert not cpu_amx.takes(weight)
    with pytest.raises(ValueError, match="packed: the AMX product cannot run on this CPU"):
        cpu_amx.linear(torch.randn(2, 64).to(BF16), cpu_gemm.pack(weight))
