"""The merged gate/up product fused with SiLU * up (``cpu_gemm.silu_mul_linear``, ``cpu_gemm.c``'s
gemm_silu_mul) on random inputs: bit for bit the C GEMM followed by ``cpu_fused``'s SiLU * up at every row
count the kernel treats differently (AVX-512: 1..7 rows read in place, 8..16 a packed block of up to 12 and
its tail, from 17 rows blocks of 12 read in place in triplets of rows, their tails; AVX2: 6-row blocks, gate
then up), with bias, strided rows, 1 and 2 threads; close to torch's ``F.silu(gate) * up``; refused where the
halves do not start on a tile; and the layer runs it only where its plan runs the C GEMM."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pagedray.kernels.cpu import cpu_fused, cpu_gemm
from pagedray.workers.layers import packed_gemm
from pagedray.workers.layers.linear import ColumnParallelLinear, Segment

F32, BF16 = torch.float32, torch.bfloat16
needs_gemm = pytest.mark.skipif(not cpu_gemm.available(F32), reason="this CPU or compiler has neither AVX-512 nor AVX2")
needs_bf16 = pytest.mark.skipif(not cpu_gemm.available(BF16), reason="this CPU or compiler has no AVX512-BF16")
DTYPES = [pytest.param(F32, id="f32", marks=needs_gemm), pytest.param(BF16, id="bf16", marks=needs_bf16)]
ROWS = (1, 2, 7, 8, 11, 12, 13, 19, 24, 25, 40, 100)


def _gate_up(dtype, inter: int, in_features: int, seed: int, with_bias: bool):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(2 * inter, in_features, generator=gen) * 0.1).to(dtype)     # [2 * inter, in]: gate; up
    bias = torch.randn(2 * inter, generator=gen).to(dtype) if with_bias else None
    return gen, weight, bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_product_has_the_bits_of_the_product_then_silu(dtype, with_bias, torch_threads):
    gen, weight, bias = _gate_up(dtype, 48, 96, 7, with_bias)                          # 3 tile pairs
    packed = cpu_gemm.pack(weight)
    wide = torch.randn(max(ROWS), 2 * 96, generator=gen).to(dtype)
    for rows in ROWS:
        for x in (wide[:rows, :96].contiguous(), wide[:rows, 5:101]):                 # contiguous, row stride 192
            want = cpu_fused.silu_and_mul_cpu(cpu_gemm.linear(x, packed, bias))      # [rows, 48]
            got = cpu_gemm.silu_mul_linear(x, packed, bias)
            assert got.shape == (rows, 48) and got.dtype == dtype
            assert torch.equal(got, want), (rows, x.stride())


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_product_is_close_to_torch_silu_of_the_product(dtype):
    gen, weight, _ = _gate_up(dtype, 64, 128, 3, False)
    x = torch.randn(2, 17, 128, generator=gen).to(dtype)                              # [batch, tokens, in]
    got = cpu_gemm.silu_mul_linear(x, cpu_gemm.pack(weight))
    gate, up = cpu_gemm.linear(x, cpu_gemm.pack(weight)).chunk(2, dim=-1)            # each [2, 17, 64]
    want = F.silu(gate) * up
    assert got.shape == (2, 17, 64)
    tol = {"rtol": 2 ** -7, "atol": 1e-6} if dtype == BF16 else {"rtol": 1e-6, "atol": 1e-7}
    torch.testing.assert_close(got, want, **tol)
    if dtype == BF16:                 # the same formula: exp's last-ulp differences vanish in the bf16 rounding
        assert (got == want).double().mean() >= 0.98
    assert cpu_gemm.silu_mul_linear(torch.empty(0, 128, dtype=dtype), cpu_gemm.pack(weight)).shape == (0, 64)


@needs_gemm
def test_halves_that_do_not_start_on_a_tile_are_refused():
    packed = cpu_gemm.pack(torch.randn(48, 32))            # inter 24: the up half starts inside a tile
    assert not cpu_gemm.fuses_silu_mul(packed.out_features) and cpu_gemm.fuses_silu_mul(64)
    with pytest.raises(ValueError, match="^packed: a fused gate/up product"):
        cpu_gemm.silu_mul_linear(torch.randn(3, 32), packed)
    with pytest.raises(ValueError, match="^x: last dimension 16"):
        cpu_gemm.silu_mul_linear(torch.randn(3, 16), cpu_gemm.pack(torch.randn(64, 32)))
    assert packed_gemm.linear_silu_mul(torch.randn(3, 32), None, packed_gemm.pack_weight(torch.randn(48, 32), "c")) \
        is None


@needs_gemm
@pytest.mark.parametrize("plan", ["c", "onednn"])
def test_the_layer_fuses_only_where_its_plan_runs_the_c_gemm(plan):
    if plan not in packed_gemm.candidates(torch.randn(64, 32)):
        pytest.skip(f"{plan} does not run here")
    layer = ColumnParallelLinear(32, [Segment(32, 0, 32), Segment(32, 0, 32)], False, F32, torch.device("cpu"))
    layer.weight = torch.nn.Parameter(torch.randn(64, 32) * 0.1, requires_grad=False)
    layer.packed_weight = packed_gemm.pack_weight(layer.weight, plan)
    x = torch.randn(20, 32)
    fused = packed_gemm.linear_silu_mul(x, None, layer.packed_weight)
    assert (fused is not None) == (plan == "c")
    want = cpu_fused.silu_and_mul_cpu(layer(x))                          # the product, then the activation
    assert torch.equal(layer.forward_silu_and_mul(x), want)
