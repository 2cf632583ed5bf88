"""The CPU C versions of RMSNorm, rotary and SiLU * up (``kernels/cpu/cpu_fused.c``) against their torch
references (``reference.fused``) on random inputs: bit for bit in bfloat16 and for rotary, within the last
bit for a float32 RMSNorm (its sum of squares runs in another order), within a few ulps for a float32 SiLU
(its own exp) and one bfloat16 ulp for a bfloat16 one; the dispatch in ``fused_ops``; the fallback."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.spies import record_calls
from pagedray.kernels import fused_ops
from pagedray.kernels.cpu import cpu_build, cpu_fused
from pagedray.kernels.reference.fused import (
    apply_rotary_reference,
    rms_norm_reference,
    rotary_cos_sin,
    silu_and_mul_reference,
)

F32, BF16 = torch.float32, torch.bfloat16
needs_library = pytest.mark.skipif(cpu_fused._library() is None, reason="no C compiler to build cpu_fused.c")


def _rows(gen, rows: int, size: int, dtype, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(rows, size, generator=gen) * scale).to(dtype)


def _norm_equal(got: torch.Tensor, expected: torch.Tensor) -> None:
    if got.dtype == F32:   # 1 / sqrt may move by an ulp, every element of the row with it (<= 2 ulps)
        torch.testing.assert_close(got, expected, rtol=2 ** -21, atol=0)
    else:
        assert torch.equal(got, expected)


@needs_library
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows,size", [(1, 576), (16, 576), (300, 576), (7, 60), (5, 13)])   # tails of 8
def test_rms_norm_matches_reference(dtype, rows, size):
    gen = torch.Generator().manual_seed(rows * 1000 + size)
    x, residual = _rows(gen, rows, size, dtype), _rows(gen, rows, size, dtype, 1.0)
    weight = (1 + 0.2 * torch.randn(size, generator=gen)).to(dtype)
    normed, new_residual = cpu_fused.rms_norm_cpu(x, weight, 1e-5, residual)
    ref_normed, ref_residual = rms_norm_reference(x, weight, 1e-5, residual)
    assert torch.equal(new_residual, ref_residual)
    _norm_equal(normed, ref_normed)
    _norm_equal(cpu_fused.rms_norm_cpu(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5))
    wide = _rows(gen, rows, 2 * size, dtype)[:, :size]                   # strided rows, out = x in place
    expected = rms_norm_reference(wide, weight, 1e-5)
    assert cpu_fused.rms_norm_cpu(wide, weight, 1e-5, out=wide) is wide
    _norm_equal(wide, expected)


@needs_library
def test_rms_norm_keeps_nan_and_inf_as_torch_does():
    x = torch.tensor([[1.0, float("nan"), 2.0, 3.0], [float("inf"), 1.0, 2.0, 3.0], [1e-30, 0.0, 0.0, 0.0]])
    weight = torch.ones(4)
    for dtype in (F32, BF16):
        got, expected = cpu_fused.rms_norm_cpu(x.to(dtype), weight.to(dtype), 1e-6), \
            rms_norm_reference(x.to(dtype), weight.to(dtype), 1e-6)
        assert torch.equal(got.isnan(), expected.isnan())
        torch.testing.assert_close(got, expected, equal_nan=True)


@needs_library
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim", [(16, 9, 3, 64), (70, 4, 2, 128), (3, 2, 1, 36)])
def test_rotary_equals_reference_on_a_qkv_slice(dtype, tokens, q_heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(tokens + head_dim)
    qkv = torch.randn(tokens, q_heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)   # [tokens, H, D]
    positions = torch.randint(0, 30000, (tokens,), generator=gen)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, signed_sin = rotary_cos_sin(positions, inv_freq, dtype)
    x = qkv[:, :q_heads + kv_heads]                                           # q and k, token-strided
    got = cpu_fused.apply_rotary_cpu(x, cos, signed_sin)
    assert got.is_contiguous() and torch.equal(got, apply_rotary_reference(x, cos, signed_sin))


@needs_library
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows,inter", [(2, 1536), (16, 1536), (64, 1536), (5, 13)])   # 64 x 1536: threaded
def test_silu_and_mul_matches_reference(dtype, rows, inter):
    gen = torch.Generator().manual_seed(rows * 7 + inter)
    gate_up = torch.cat([_rows(gen, rows, inter, dtype, 4.0), _rows(gen, rows, inter, dtype, 1.0)], dim=1)
    gate_up[0, :4] = torch.tensor([-100.0, -87.5, 0.0, 60.0])   # exp underflow, zero, a large gate
    got, expected = cpu_fused.silu_and_mul_cpu(gate_up), silu_and_mul_reference(gate_up)
    if dtype == F32:
        torch.testing.assert_close(got, expected, rtol=2 ** -20, atol=1e-30)
    else:   # silu rounds to bfloat16 before the product: an ulp there, after rounding rarely one here
        torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -7, atol=1e-30)
        assert (got[1:] != expected[1:]).float().mean() < 0.01        # the random rows
    strided = torch.zeros(rows, 2 * inter + 6, dtype=dtype)
    strided[:, :2 * inter] = gate_up
    assert torch.equal(cpu_fused.silu_and_mul_cpu(strided[:, :2 * inter]), got)   # row stride != width


def test_fused_ops_dispatch_to_c_where_it_takes_the_layout(monkeypatch):
    calls = record_calls(monkeypatch, cpu_fused, ("rms_norm_cpu", "apply_rotary_cpu", "silu_and_mul_cpu"))
    gen = torch.Generator().manual_seed(3)
    x, weight = _rows(gen, 4, 64, F32), torch.ones(64)
    fused_ops.rms_norm(x, weight, 1e-6)
    fused_ops.rms_norm(x.view(4, 2, 32), torch.ones(32), 1e-6)                # per-head norm: the reference
    fused_ops.rms_norm(x.half(), weight.half(), 1e-6)                          # fp16: the reference
    qk = torch.randn(4, 3, 64, generator=gen)
    cos, signed_sin = rotary_cos_sin(torch.arange(4), torch.rand(32, generator=gen), F32)
    fused_ops.apply_rotary(qk, cos, signed_sin)
    fused_ops.silu_and_mul(x)
    fused_ops.silu_and_mul(x.half())                                           # fp16: the reference
    expected = ["rms_norm_cpu", "apply_rotary_cpu", "silu_and_mul_cpu"] if cpu_fused._library() is not None else []
    assert calls == expected
    with pytest.raises(ValueError, match="cos: expected shape"):
        fused_ops.apply_rotary(qk, cos[:2], signed_sin)
    with pytest.raises(ValueError, match="signed_sin: expected shape"):
        fused_ops.apply_rotary(qk, cos, signed_sin.half())


def test_disabled_library_falls_back_to_the_reference(monkeypatch, caplog):
    monkeypatch.setenv("PAGEDRAY_CPU_KERNELS", "0")
    cpu_fused._library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
            x, weight = torch.randn(4, 64), torch.ones(64)
            assert not cpu_fused.supports_rms_norm(x, None, None)
            assert torch.equal(fused_ops.rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6))
        assert "CPU fused ops off (PAGEDRAY_CPU_KERNELS=0)" in caplog.text
    finally:
        monkeypatch.delenv("PAGEDRAY_CPU_KERNELS")
        cpu_fused._library.cache_clear()
