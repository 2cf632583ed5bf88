"""The compiled CPU decode kernel (``kernels/cpu/cpu_decode.c``) against the float64 oracle and the torch reference.

Random inputs scattered into shuffled blocks among junk (``make_paged_case``), odd lengths, GQA groups
1-8 and MQA, sliding windows, ALiBi, block sizes 8-64, head dims 32-256, float32 and bfloat16, queries
that are strided views, and thread counts. The kernel is built with the machine's C compiler; where
there is none these tests skip (``test_kernel_builds_where_a_compiler_exists`` fails instead when a
compiler is there but the build does not work).
"""

from __future__ import annotations

import logging
import math
import shutil

import pagedray.kernels.api as api
import pytest
import torch
from helpers.paged_kv_cases import alibi_like_slopes, assert_close_to_oracle, dense_attention, make_paged_case, nan_like
from pagedray.kernels import paged_attention, paged_decode, paged_decode_reference
from pagedray.kernels.cpu import cpu_build, cpu_decode

F32, BF16 = torch.float32, torch.bfloat16
CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler to build the CPU kernel")

# (q_heads, kv_heads, head_dim, block_size, dtype, seq_lens, alibi, window)
SPECS = [
    (9, 3, 64, 16, F32, (1, 16, 17, 250, 301), False, None),      # SmolLM2's heads, odd lengths
    (9, 3, 64, 16, BF16, (1, 16, 17, 250, 301), False, None),
    (4, 4, 32, 8, F32, (3, 8, 9, 100), False, None),              # group 1, head_dim 32
    (8, 2, 128, 32, BF16, (300, 7, 33), False, 50),               # group 4, window
    (16, 2, 96, 64, F32, (100, 1, 65, 129), True, 30),            # group 8, ALiBi + window, head_dim 96
    (4, 1, 256, 16, F32, (250, 18), True, None),                  # MQA, head_dim 256
    (2, 1, 64, 8, BF16, (1, 3, 77), False, 1),                    # one visible key per query
    (6, 2, 48, 16, BF16, (5, 70, 130), False, None),              # bf16 with an odd number of 16-wide parts
]


def _case(spec, seed: int):
    q_heads, kv_heads, head_dim, block_size, dtype, lens, alibi, window = spec
    gen = torch.Generator().manual_seed(seed)
    case = make_paged_case(gen, list(lens), kv_heads, head_dim, block_size, dtype, CPU)
    q = torch.randn((len(lens), q_heads, head_dim), generator=gen).to(dtype)
    slopes = alibi_like_slopes(q_heads, CPU) if alibi else None
    return case, q, 1.0 / math.sqrt(head_dim), slopes, window


def _oracle(case, q, scale, slopes, window):
    return torch.cat([dense_attention(q[i:i + 1], case.keys[i], case.values[i], scale, slopes, window)
                      for i in range(q.shape[0])])


def test_kernel_builds_where_a_compiler_exists():
    if shutil.which("cc") is None:
        pytest.skip("no cc on this machine")
    assert cpu_decode.available()


@needs_kernel
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"g{s[0] // s[1]}-d{s[2]}-b{s[3]}-{str(s[4])[6:]}")
def test_kernel_matches_oracle_and_reference(spec):
    case, q, scale, slopes, window = _case(spec, seed=sum(spec[:4]) + len(spec[5]))
    out = nan_like(q.shape, q.dtype, CPU)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale, slopes, window)
    assert cpu_decode.paged_decode_cpu(*args, out) is out
    assert_close_to_oracle(out, _oracle(case, q, scale, slopes, window), q.dtype)
    reference = paged_decode_reference(*args).float()
    ulps = 1e-5 if q.dtype == F32 else 2 ** -7      # float32: last bits; bfloat16: one rounding step
    assert ((out.float() - reference).abs() <= ulps * reference.abs().clamp(min=1)).all()


@needs_kernel
def test_empty_sequence_outputs_zeros_and_others_unaffected():
    case, q, scale, _, _ = _case((4, 2, 64, 16, F32, (0, 40, 0), False, None), seed=3)
    out = cpu_decode.paged_decode_cpu(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale)
    assert torch.equal(out[0], torch.zeros(4, 64)) and torch.equal(out[2], torch.zeros(4, 64))
    assert_close_to_oracle(out[1:2], dense_attention(q[1:2], case.keys[1], case.values[1], scale), F32)


@needs_kernel
def test_strided_query_view_and_thread_counts_agree():
    """q as a head slice of a fused projection (token stride > Hq * D) gives the same bits as a
    contiguous copy, and 1 and 2 threads give the same bits (one work item never spans threads)."""
    case, q, scale, _, _ = _case((6, 2, 64, 16, BF16, (5, 70, 130, 33), False, None), seed=4)
    fused = torch.randn((4, 10, 64)).to(BF16)
    fused[:, 2:8] = q
    view = fused[:, 2:8]
    args = (case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_decode.paged_decode_cpu(q, *args)
        torch.set_num_threads(2)
        two = cpu_decode.paged_decode_cpu(view, *args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@needs_kernel
def test_public_decode_runs_the_kernel_on_cpu(monkeypatch):
    """paged_decode and paged_attention (all-decode and mixed) send CPU decode rows to the kernel;
    float16, which the kernel does not take, stays on the reference."""
    calls = []
    kernel = cpu_decode.paged_decode_cpu

    def spy(*args, **kwargs):
        calls.append(args[0].dtype)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(cpu_decode, "paged_decode_cpu", spy)
    case, q, scale, _, _ = _case((4, 2, 64, 16, F32, (40, 1, 100), False, None), seed=5)
    expected = _oracle(case, q, scale, None, None)
    assert_close_to_oracle(paged_decode(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale),
                           expected, F32)
    cu = torch.arange(4, dtype=torch.int32)
    assert_close_to_oracle(paged_attention(q, case.k_cache, case.v_cache, cu, case.seq_lens, case.block_tables,
                                           scale), expected, F32)
    assert calls == [F32, F32]
    # mixed: two decode rows and a 5-token chunk (the chunk's keys are the last 5 of its 60), both dtypes
    for dtype in (F32, BF16):
        gen = torch.Generator().manual_seed(6)
        mixed = make_paged_case(gen, [40, 60, 100], 2, 64, 16, dtype, CPU)
        mq = torch.randn((7, 4, 64), generator=gen).to(dtype)
        cu = torch.tensor([0, 1, 6, 7], dtype=torch.int32)
        out = paged_attention(mq, mixed.k_cache, mixed.v_cache, cu, mixed.seq_lens, mixed.block_tables, scale)
        oracle = torch.cat([dense_attention(mq[a:b], mixed.keys[i], mixed.values[i], scale)
                            for i, (a, b) in enumerate([(0, 1), (1, 6), (6, 7)])])
        assert_close_to_oracle(out, oracle, dtype)
    assert calls == [F32, F32, F32, BF16]
    half = q.to(torch.float16)
    paged_decode(half, case.k_cache.half(), case.v_cache.half(), case.block_tables, case.seq_lens, scale)
    assert calls == [F32, F32, F32, BF16]


def test_disabled_or_unbuildable_kernel_falls_back_to_the_reference(monkeypatch, caplog):
    """PAGEDRAY_CPU_KERNELS=0 or a compiler that fails: a warning naming why, and the reference runs."""
    case, q, scale, _, _ = _case((4, 2, 64, 16, F32, (40, 9), False, None), seed=7)
    try:
        for env, value in (("PAGEDRAY_CPU_KERNELS", "0"), ("CC", "/nonexistent/cc")):
            monkeypatch.setenv(env, value)
            cpu_decode._library.cache_clear()
            with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
                assert not cpu_decode.available()
            assert value in caplog.text
            assert api._decode_kernel(False, q, case.k_cache) is paged_decode_reference
            out = paged_decode(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale)
            assert_close_to_oracle(out, _oracle(case, q, scale, None, None), F32)
            monkeypatch.delenv(env)
            caplog.clear()
    finally:
        cpu_decode._library.cache_clear()


@needs_kernel
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_rows_outside_the_visible_range_never_reach_the_output(dtype):
    """Rows past seq_len in a sequence's last block, rows left of its window and unused blocks hold NaN
    and inf: the kernel scores 8 rows at a time, so it reads some of them, and must mask them out."""
    lens, window = (17, 250, 301, 5), 40
    case, q, scale, _, _ = _case((9, 3, 64, 16, dtype, lens, False, None), seed=11)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    k_cache[:], v_cache[:] = float("nan"), float("inf")
    for i, n in enumerate(lens):
        for p in range(max(0, n - window), n):     # only the rows the window sees keep their values
            block = case.block_tables[i, p // 16]
            k_cache[block, p % 16], v_cache[block, p % 16] = case.keys[i][p], case.values[i][p]
    out = cpu_decode.paged_decode_cpu(q, k_cache, v_cache, case.block_tables, case.seq_lens, scale, None, window)
    clean = cpu_decode.paged_decode_cpu(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                        scale, None, window)
    assert torch.isfinite(out).all() and torch.equal(out, clean)
    reference = paged_decode_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale,
                                       None, window).float()
    ulps = 1e-5 if dtype == F32 else 2 ** -7
    assert ((out.float() - reference).abs() <= ulps * reference.abs().clamp(min=1)).all()


@needs_kernel
def test_a_head_size_off_the_vector_width_runs_the_reference():
    """The kernel vectorises head_dim by 16: a head of 24 (the tiny Qwen3's) is not taken, and the CPU
    decode entry point then answers with the torch reference, still right."""
    case, q, scale, _, _ = _case((4, 2, 24, 16, F32, (5, 40, 17), False, None), seed=11)
    assert not cpu_decode.supports(q, case.k_cache)
    assert cpu_decode.supports(torch.zeros(1, 4, 32), torch.zeros(8, 16, 2, 32))
    out = paged_decode(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale)
    assert_close_to_oracle(out, _oracle(case, q, scale, None, None), F32)
