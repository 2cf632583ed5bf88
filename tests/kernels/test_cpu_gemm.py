"""The CPU GEMM in C (``kernels/cpu/cpu_gemm.c``), float32 and bfloat16, against a float64 product on random
inputs: every row count the kernel treats differently (AVX-512: 1..7 rows read in place, 8..16 packed
step-major in one pass, from 17 rows blocks of 12 over tile pairs read in place in triplets of rows, their
tails read in place; AVX2: blocks of up to 6 rows over one tile), output widths that end inside a tile, bias,
1 and 2 threads, strided, misaligned and 3-D inputs; each row's bits the same in any block; the packed
layouts element by element; the argument checks; the layers' choice between it and oneDNN; the
AVX2 build's bits equal to the native build's."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
import torch
from pagedray.kernels.cpu import cpu_build, cpu_gemm
from pagedray.workers.layers import packed_gemm

F32, BF16 = torch.float32, torch.bfloat16
needs_gemm = pytest.mark.skipif(not cpu_gemm.available(F32), reason="this CPU or compiler has neither AVX-512 nor AVX2")
needs_bf16 = pytest.mark.skipif(not cpu_gemm.available(BF16), reason="this CPU or compiler has no AVX512-BF16")
DTYPES = [pytest.param(F32, id="f32", marks=needs_gemm), pytest.param(BF16, id="bf16", marks=needs_bf16)]


def _assert_product(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """y is the float64 product up to float32 summation error (k roundings of |x| @ |w|^T) and, in
    bfloat16, one final rounding (half a bf16 step), a bound a misplaced weight exceeds by orders of
    magnitude; in bf16 also 99% of the elements exactly the exact value rounded."""
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())     # [rows, out]
    k = x.shape[-1]
    final = 2 ** -8 if y.dtype == BF16 else 2 ** -24
    bound = exact.abs() * final + k * 2 ** -23 * (x.double().abs() @ weight.double().abs().T) + 1e-30
    assert y.dtype == x.dtype and y.shape == exact.shape
    assert ((y.double() - exact).abs() <= bound).all()
    assert y.dtype == F32 or (y == exact.to(y.dtype)).double().mean() >= 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (251, 64), (40, 2), (3, 30)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_product_matches_float64(dtype, out_features, in_features, with_bias, torch_threads):
    gen = torch.Generator().manual_seed(out_features * 7 + in_features)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(dtype)   # [out, in]
    bias = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None    # [out]
    packed = cpu_gemm.pack(weight)
    for rows in (1, 2, 7, 8, 12, 15, 16, 17, 20, 23, 24, 25, 36, 100):
        x = torch.randn(rows, in_features, generator=gen).to(dtype)                    # [rows, in]
        _assert_product(cpu_gemm.linear(x, packed, bias), x, weight, bias)


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_row_gets_the_bits_it_gets_alone(dtype, torch_threads):
    """A row's sums are the same whichever block it is in, read in place (in triplets of rows from 17 rows on)
    or packed (the same k order): every row of a product of 8..40 rows equals, bit for bit, that row multiplied
    alone (one row: read in place); so does every row of a row repeated through a zero row stride."""
    gen = torch.Generator().manual_seed(11)
    weight = (torch.randn(83, 160, generator=gen) * 0.1).to(dtype)              # [out, in]: a tile left partial
    bias = torch.randn(83, generator=gen).to(dtype)
    packed = cpu_gemm.pack(weight)
    wide = torch.randn(40, 2 * 160, generator=gen).to(dtype)
    for rows in (8, 11, 16, 20, 31, 40):
        x = wide[:rows, 3:163]                                                   # [rows, in], row stride 320
        y = cpu_gemm.linear(x, packed, bias)
        alone = torch.cat([cpu_gemm.linear(x[i:i + 1], packed, bias) for i in range(rows)])
        assert torch.equal(y, alone), rows
    # one row repeated through a zero row stride (an expanded tensor): every row read in place or packed is it
    for rows in (5, 12, 16, 29):
        x = wide[0, 3:163].expand(rows, 160)                                     # [rows, in], row stride 0
        assert x.stride(0) == 0
        assert torch.equal(cpu_gemm.linear(x, packed, bias), alone[:1].expand(rows, 83)), rows


@needs_gemm
def test_float32_odd_width_and_close_to_f_linear():
    gen = torch.Generator().manual_seed(5)
    weight, x = torch.randn(33, 31, generator=gen), torch.randn(9, 31, generator=gen)   # odd k: fine in fp32
    y = cpu_gemm.linear(x, cpu_gemm.pack(weight))
    _assert_product(y, x, weight, None)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, weight), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_3d_and_misaligned_inputs(dtype):
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(70, 96, generator=gen) * 0.1).to(dtype)
    packed = cpu_gemm.pack(weight)
    wide = torch.randn(19, 2 * 96 + 1, generator=gen).to(dtype)
    for x in (wide[:, :96], wide[:, 1:97], wide[:, ::2][:, :96]):           # row stride, odd offset, column stride
        _assert_product(cpu_gemm.linear(x, packed), x, weight, None)
    x = torch.randn(2, 5, 96, generator=gen).to(dtype)                       # [batch, tokens, in]
    y = cpu_gemm.linear(x, packed)
    assert y.shape == (2, 5, 70)
    _assert_product(y.reshape(10, 70), x.reshape(10, 96), weight, None)
    assert cpu_gemm.linear(torch.empty(0, 96, dtype=dtype), packed).shape == (0, 70)


@needs_gemm
def test_packed_layouts_group_sixteen_outputs_per_step():
    weight = torch.arange(20 * 6, dtype=torch.float32).reshape(20, 6)       # exact in bf16 too
    pairs, singles = cpu_gemm.pack(weight.bfloat16()) if cpu_gemm.available(BF16) else None, cpu_gemm.pack(weight)
    assert singles.data.shape == (2, 6, 16) and (singles.out_features, singles.in_features) == (20, 6)
    if pairs is not None:
        assert pairs.data.shape == (2, 3, 16, 2)
    for t in range(2):
        for c in range(16):
            row = 16 * t + c
            for col in range(6):
                expected = weight[row, col] if row < 20 else 0
                assert singles.data[t, col, c] == expected
                assert pairs is None or pairs.data[t, col // 2, c, col % 2] == expected


@needs_gemm
def test_bad_arguments_are_named():
    weight = torch.randn(8, 6)
    packed = cpu_gemm.pack(weight)
    with pytest.raises(ValueError, match="^weight"):
        cpu_gemm.pack(torch.randn(8, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match="^weight"):
        cpu_gemm.pack(torch.randn(8))
    with pytest.raises(ValueError, match="^x"):
        cpu_gemm.linear(torch.randn(2, 6).bfloat16(), packed)     # dtype other than the weight's
    with pytest.raises(ValueError, match="^x: last dimension 4"):
        cpu_gemm.linear(torch.randn(2, 4), packed)
    with pytest.raises(ValueError, match="^bias"):
        cpu_gemm.linear(torch.randn(2, 6), packed, torch.randn(7))
    with pytest.raises(ValueError, match="^packed"):
        cpu_gemm.linear(torch.randn(2, 6), weight)


@needs_bf16
def test_bf16_weight_with_odd_inputs_is_refused():
    with pytest.raises(ValueError, match="^weight"):
        cpu_gemm.pack(torch.randn(8, 5).bfloat16())


@needs_gemm
def test_layers_tile_pack_for_the_c_product_and_offer_it_only_where_it_runs(monkeypatch):
    weight = torch.randn(48, 32)
    packed = packed_gemm.pack_weight(weight, "c")
    assert isinstance(packed.tile, cpu_gemm.TilePackedWeight) and packed.onednn is None
    assert "c" in packed_gemm.candidates(weight)
    if cpu_gemm.available(BF16):
        assert "c" in packed_gemm.candidates(weight.bfloat16())
        assert "c" not in packed_gemm.candidates(torch.randn(48, 33).bfloat16())   # odd inputs: oneDNN's
    x = torch.randn(5, 32)
    _assert_product(packed_gemm.linear(x, weight, None, packed), x, weight, None)
    monkeypatch.setattr(cpu_gemm, "available", lambda dtype: False)                   # no AVX-512 or AVX2
    assert "c" not in packed_gemm.candidates(weight) and "c" not in packed_gemm.candidates(weight.bfloat16())
    with pytest.raises(ValueError, match="^plan"):
        packed_gemm.pack_weight(weight, "c")


def _avx2_build(tmp) -> ctypes.CDLL:
    """cpu_gemm.c compiled for x86-64-v3 (AVX2 + FMA, no AVX-512): the build an AVX2-only CPU gets."""
    source = cpu_gemm.SOURCE
    target = tmp / "cpu_gemm-x86-64-v3.so"
    flags = [f for f in cpu_build.FLAGS if not f.startswith("-march")]
    subprocess.run(["cc", *flags, "-march=x86-64-v3", "-I", str(source.parent), "-o", str(target), str(source),
                    "-lm"], check=True, capture_output=True)
    library = ctypes.CDLL(str(target))
    library.gemm_supported.argtypes, library.gemm_supported.restype = [ctypes.c_int], ctypes.c_int
    cpu_build.declare(library, cpu_gemm._SIGNATURES)
    return library


@needs_gemm
def test_the_avx2_build_gives_the_native_builds_bits(tmp_path, torch_threads):
    """On AVX2 the kernel runs smaller blocks (6 rows over one tile, gate/up pairs 3 rows at a time) but the same
    float32 sums in the same k order: the x86-64-v3 build's products (plain and gate/up + SiLU) equal the
    native build's bit for bit at every row count its blocks treat differently, and the float64 product."""
    if shutil.which("cc") is None or not {"avx2", "fma", "f16c"} <= set(cpu_build._cpu_flags().split()):
        pytest.skip("no C compiler, or this CPU runs no AVX2 code")
    avx2 = _avx2_build(tmp_path)
    assert avx2.gemm_supported(cpu_build.DTYPE_CODES[F32]) == 1
    assert avx2.gemm_supported(cpu_build.DTYPE_CODES[BF16]) == 0     # vdpbf16ps is AVX512-BF16's
    gen = torch.Generator().manual_seed(21)
    for out_features, in_features in ((83, 160), (96, 64)):         # a partial tile; gate/up halves of 48
        weight = torch.randn(out_features, in_features, generator=gen) * 0.1                     # [out, in]
        bias = torch.randn(out_features, generator=gen)
        packed = cpu_gemm.pack(weight)
        for rows in (1, 3, 4, 6, 7, 12, 13, 16, 17, 40):
            x = torch.randn(rows, in_features, generator=gen)                                   # [rows, in]
            y = cpu_gemm.multiply(avx2.gemm, x, packed, bias, out_features)
            _assert_product(y, x, weight, bias)
            assert torch.equal(y, cpu_gemm.linear(x, packed, bias)), (out_features, rows)
            if cpu_gemm.fuses_silu_mul(out_features):
                fused = cpu_gemm.multiply(avx2.gemm_silu_mul, x, packed, bias, out_features // 2)
                assert torch.equal(fused, cpu_gemm.silu_mul_linear(x, packed, bias)), rows
