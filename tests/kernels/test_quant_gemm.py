"""``kernels.quant_gemm``: the Triton GEMM over GPTQ-packed weights (under ``TRITON_INTERPRET=1`` on CPU)
and its torch reference, both against x @ W^T with W built from the codes directly (packed by the tests'
own packer, ``helpers.quantized_checkpoints``): 4 and 8 bits, activation-order groups (a permuted g_idx),
sizes that fill no tile, float32 and float16 inputs, codes and zero points over their whole range; every
kernel path (per-row groups, one group per K slice after ``group_rows``, split K, dequantize-then-matmul)."""

from __future__ import annotations

import pytest
import torch
from helpers.paged_kv_cases import kernel_device, seed_of
from helpers.quantized_checkpoints import pack_words
from pagedray import kernels
from pagedray.kernels.quant_gemm import group_rows


def _case(m: int, k: int, n: int, bits: int, group: int, act_order: bool, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    top = (1 << bits) - 1
    codes = torch.randint(0, top + 1, (k, n), generator=gen)
    groups = k // group
    zeros = torch.randint(0, top + 1, (groups, n), generator=gen)
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.001).half()
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    weight_t = (codes - zeros[g_idx]).float() * scales.float()[g_idx]                # [K, N]
    x = torch.randn(m, k, generator=gen).to(dtype)
    device = kernel_device()
    packed = pack_words(codes, 0, bits)
    args = [t.to(device) for t in (x, packed, zeros.to(torch.int32), scales, g_idx.to(torch.int32))]
    want = x.float() @ weight_t.to(dtype).float()
    return args, want


@pytest.mark.parametrize("m, k, n, bits, group, act_order, dtype", [
    (1, 64, 40, 4, 16, False, torch.float32),
    (5, 96, 72, 4, 32, True, torch.float32),
    (20, 64, 130, 8, 64, False, torch.float16),
    (70, 128, 24, 4, 128, True, torch.float16),
])
@pytest.mark.parametrize("path", ["reference", "triton"])
def test_quant_gemm_equals_x_times_the_dequantized_weight(path, m, k, n, bits, group, act_order, dtype):
    args, want = _case(m, k, n, bits, group, act_order, dtype, seed_of("qgemm", m, k, n, bits))
    got = kernels.quant_gemm(*args, bits, use_triton=path == "triton")
    assert got.dtype == dtype and got.shape == (m, n)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    scale = want.abs().max()
    assert scale > 0.1
    torch.testing.assert_close(got.float().cpu() / scale, want / scale, rtol=0, atol=tolerance)


# (rows, slice of the weight's input rows or None, kernel config or None for the default)
PATHS = [
    (5, None, dict(dense=False, GROUPED=True, BLOCK_M=16, BLOCK_N=32, BLOCK_KW=16, SPLIT_K=1)),
    (5, None, dict(dense=False, GROUPED=True, BLOCK_M=16, BLOCK_N=32, BLOCK_KW=16, SPLIT_K=3)),
    (20, None, dict(dense=False, GROUPED=False, BLOCK_M=16, BLOCK_N=32, BLOCK_KW=16, SPLIT_K=2)),
    (7, None, dict(dense=True, GROUPED=True, BLOCK_N=32, BLOCK_KW=16)),
    (7, None, dict(dense=True, GROUPED=False, BLOCK_N=32, BLOCK_KW=16)),
    (3, None, None),
    (3, (128, 384), None),            # a tensor-parallel slice: starts at group 1, uneven groups under act order
]


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("rows, rows_slice, config", PATHS)
def test_every_kernel_path_after_group_rows_equals_the_dequantized_product(rows, rows_slice, config, act_order):
    """group_rows' layout (rows sorted by group, perm, group_size) through each path of the Triton kernel."""
    k, n, bits, group = 512, 40, 4, 128                 # 4-bit slices are 128 rows: 4 slices, 4 groups
    args, want = _case(rows, k, n, bits, group, act_order, torch.float32, seed_of("qgemm-paths", rows, act_order))
    x, qweight, zeros, scales, g_idx = args
    if rows_slice is not None:
        lo, hi = rows_slice
        x, qweight, g_idx = x[:, lo:hi].contiguous(), qweight[lo // 8:hi // 8].contiguous(), g_idx[lo:hi].contiguous()
        want = kernels.quant_gemm_reference(x, qweight, zeros, scales, g_idx, bits)
    qweight, zeros, scales, g_idx, perm, group_size = group_rows(qweight, zeros, scales, g_idx, bits)
    assert (perm is not None) == act_order
    assert group_size == (0 if act_order and rows_slice else group)
    got = kernels.quant_gemm_reference(x, qweight, zeros, scales, g_idx, bits, perm)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())
    if config is not None and config["GROUPED"] and not group_size:
        pytest.skip("a grouped config needs uniform groups")     # not reached: PATHS' grouped rows are uniform
    from pagedray.kernels.triton.quant_gemm_triton import quant_gemm_triton
    got = quant_gemm_triton(x, qweight, zeros, scales, g_idx, bits, perm, group_size, config)
    scale = want.abs().max()
    torch.testing.assert_close(got / scale, want / scale, rtol=0, atol=1e-4)


def _float8_case(m: int, k: int, n: int, group: int, dtype, seed: int):
    """8-bit codes that are every float8 e4m3fn bit pattern but NaN (subnormals, +-0, 448 included), grouped
    scales -> (x, qweight, zeros, scales, g_idx), x @ W^T in float32."""
    gen = torch.Generator().manual_seed(seed)
    patterns = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F])
    codes = patterns[torch.randint(0, len(patterns), (k, n), generator=gen)]
    codes.view(-1)[: len(patterns)] = patterns                                            # each pattern at least once
    scales = (torch.rand(k // group, n, generator=gen) * 0.01 + 0.001).float()
    g_idx = torch.arange(k) // group
    weight_t = codes.to(torch.uint8).view(torch.float8_e4m3fn).float() * scales[g_idx]   # [K, N]
    x = torch.randn(m, k, generator=gen).to(dtype)
    zeros = torch.zeros(k // group, n, dtype=torch.int32)
    args = [t.to(kernel_device()) for t in (x, pack_words(codes, 0, 8), zeros, scales, g_idx.to(torch.int32))]
    return args, x.float() @ weight_t.to(dtype).float()


@pytest.mark.parametrize("rows, config", [
    (3, None),
    (20, None),
    (5, dict(dense=False, GROUPED=True, BLOCK_M=16, BLOCK_N=32, BLOCK_KW=16, SPLIT_K=2)),
    (5, dict(dense=False, GROUPED=False, BLOCK_M=16, BLOCK_N=32, BLOCK_KW=16, SPLIT_K=1)),
    (7, dict(dense=True, GROUPED=True, BLOCK_N=32, BLOCK_KW=16)),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_float8_codes_equal_x_times_the_e4m3_weight(rows, config, dtype):
    """``float8``: codes are e4m3 bit patterns (the kernel decodes them with integer ops and a float16, the
    reference through torch's float8 dtype), scaled per group; zero points are not read."""
    from pagedray.kernels.triton.quant_gemm_triton import quant_gemm_triton

    args, want = _float8_case(rows, 256, 40, 64, dtype, seed_of("qgemm-fp8", rows, str(dtype)))
    args[2].fill_(99)                                                  # not read
    scale = want.abs().max()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    ref = kernels.quant_gemm(*args, 8, float8=True, use_triton=False)
    torch.testing.assert_close(ref.float().cpu() / scale, want / scale, rtol=0, atol=tolerance)
    got = (kernels.quant_gemm(*args, 8, group_size=64, float8=True, use_triton=True) if config is None
           else quant_gemm_triton(*args, 8, None, 64, config, float8=True))
    assert got.dtype == dtype
    torch.testing.assert_close(got.float().cpu() / scale, want / scale, rtol=0, atol=tolerance)


def test_group_rows_keeps_a_sorted_weight_and_finds_one_group():
    """An 8-bit weight with one group (quantization int8) keeps its rows, and its group spans all of them."""
    args, _ = _case(2, 48, 16, 8, 48, False, torch.float32, 3)
    qweight, zeros, scales, g_idx, perm, group_size = group_rows(*args[1:], 8)
    assert perm is None and group_size == 48 and torch.equal(qweight, args[1])


@pytest.mark.parametrize("change, message", [
    (lambda a: [a[0].to(torch.int32), *a[1:]], "x: expected a float32"),
    (lambda a: [a[0], a[1][:-1], *a[2:]], "qweight / g_idx"),
    (lambda a: [a[0], a[1], a[2][:, :-1].contiguous(), *a[3:]], "zeros / scales"),
    (lambda a: [*a[:4], a[4] + 100], "g_idx: groups must lie in"),
    (lambda a: [a[0], a[1].to(torch.int64), *a[2:]], "qweight: expected a contiguous torch.int32"),
])
def test_bad_quant_gemm_arguments_are_value_errors_naming_them(change, message):
    args, _ = _case(3, 64, 16, 4, 32, False, torch.float32, 1)
    with pytest.raises(ValueError, match=message):
        kernels.quant_gemm(*[t.cpu() for t in change(args)], 4)


def test_float8_needs_8bit_codes():
    args, _ = _case(3, 64, 16, 4, 32, False, torch.float32, 1)
    with pytest.raises(ValueError, match="float8: float8 codes are 8 bits"):
        kernels.quant_gemm(*[t.cpu() for t in args], 4, float8=True)


@pytest.mark.parametrize("options, message", [
    (dict(group_size=16), "group_size: g_idx is not row // 16"),
    (dict(group_size=-1), "group_size: expected an int >= 0"),
    (dict(perm=torch.arange(63, dtype=torch.int32)), "perm: expected int32 \\[64\\]"),
    (dict(perm=torch.zeros(64, dtype=torch.int32)), "perm: expected a permutation"),
])
def test_bad_layout_arguments_are_value_errors_naming_them(options, message):
    args, _ = _case(3, 64, 16, 4, 32, False, torch.float32, 1)
    with pytest.raises(ValueError, match=message):
        kernels.quant_gemm(*[t.cpu() for t in args], 4, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 16, 100, 300])
def test_quant_gemm_at_model_size_gpu(bits, rows):
    """Each path at its default config on CUDA (split K at decode sizes, dequantize-then-matmul at 300 rows),
    on the group_rows layout of an activation-order weight; float32 rows must also repeat bit for bit."""
    args, want = _case(rows, 1024, 768, bits, 128, True, torch.bfloat16, seed_of("qgemm-gpu", bits, rows))
    x, *weight = args
    qweight, zeros, scales, g_idx, perm, group_size = group_rows(*[t.cpu() for t in weight], bits)
    layout = [t.cuda() for t in (qweight, zeros, scales, g_idx)]
    got = kernels.quant_gemm(x, *layout, bits, perm=perm.cuda(), group_size=group_size)
    scale = want.abs().max()
    torch.testing.assert_close(got.float().cpu() / scale, want / scale, rtol=0, atol=2e-2)
    x32 = x.float()
    first = kernels.quant_gemm(x32, *layout, bits, perm=perm.cuda(), group_size=group_size)
    assert torch.equal(first, kernels.quant_gemm(x32, *layout, bits, perm=perm.cuda(), group_size=group_size))
    want32 = kernels.quant_gemm_reference(x32.cpu(), qweight, zeros, scales, g_idx, bits, perm)
    torch.testing.assert_close(first.cpu() / scale, want32 / scale, rtol=0, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_float8_gemm_at_model_size_gpu(rows):
    """float8 codes on CUDA at each path's default config (bf16 rows; float32 rows against the reference)."""
    args, want = _float8_case(rows, 1024, 768, 128, torch.bfloat16, seed_of("qgemm-fp8-gpu", rows))
    x, *weight = args
    got = kernels.quant_gemm(x, *weight, 8, group_size=128, float8=True)
    scale = want.abs().max()
    torch.testing.assert_close(got.float().cpu() / scale, want / scale, rtol=0, atol=2e-2)
    x32 = x.float()
    got32 = kernels.quant_gemm(x32, *weight, 8, group_size=128, float8=True)
    want32 = kernels.quant_gemm_reference(x32.cpu(), *[t.cpu() for t in weight], 8, float8=True)
    torch.testing.assert_close(got32.cpu() / scale, want32 / scale, rtol=0, atol=1e-4)
