"""``kernels.quant_gemm``: the Triton GEMM over GPTQ-packed weights (under ``TRITON_INTERPRET=1`` on CPU)
and its torch reference, both against x @ W^T with W built from the codes directly (packed by the tests'
own packer, ``helpers.quantized_checkpoints``): 4 and 8 bits, activation-order groups (a permuted g_idx),
sizes that fill no tile, float32 and float16 inputs, codes and zero points over their whole range."""

from __future__ import annotations

import pytest
import torch
from helpers.paged_kv_cases import kernel_device, seed_of
from helpers.quantized_checkpoints import pack_words
from pagedray import kernels


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


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 8])
def test_quant_gemm_at_model_size_gpu(bits):
    args, want = _case(300, 1024, 768, bits, 128, True, torch.bfloat16, seed_of("qgemm-gpu", bits))
    got = kernels.quant_gemm(*args, bits)
    scale = want.abs().max()
    torch.testing.assert_close(got.float().cpu() / scale, want / scale, rtol=0, atol=2e-2)
