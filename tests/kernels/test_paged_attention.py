"""paged_attention (mixed-batch dispatcher) and the reference's batching, against the float64 oracle."""

from __future__ import annotations

import math

import pagedray.kernels.api as api
import pagedray.kernels.reference.attention as reference
import pytest
import torch
from helpers.paged_kv_cases import (
    alibi_like_slopes,
    assert_close_to_oracle,
    dense_attention,
    kernel_device,
    make_paged_case,
    nan_like,
)
from pagedray.kernels import paged_attention, paged_decode, paged_prefill, store_kv


def _batch(gen, chunks, q_heads, kv_heads, head_dim, block_size, dtype=torch.float32):
    """chunks ((history, q_len), ...) -> case, q [total, Hq, D], cu_seqlens_q, oracle output."""
    device = kernel_device()
    case = make_paged_case(gen, [h + n for h, n in chunks], kv_heads, head_dim, block_size, dtype, device)
    q_lens = [n for _, n in chunks]
    q = torch.randn((sum(q_lens), q_heads, head_dim), generator=gen).to(dtype).to(device)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return case, q, cu


def _oracle(case, q, cu, scale, slopes=None, window=None):
    starts = cu.tolist()
    return torch.cat([dense_attention(q[starts[i]:starts[i + 1]], case.keys[i], case.values[i], scale,
                                      slopes, window) for i in range(len(starts) - 1)])


class _Spy:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "reference"])
@pytest.mark.parametrize("chunks,expect_decode", [
    (((40, 1), (0, 1), (100, 1)), True),          # all decode rows
    (((40, 1), (10, 17), (100, 1)), False),        # decode rows + a prefill chunk
])
def test_dispatch_and_result(monkeypatch, chunks, expect_decode, use_triton):
    """Triton, or the torch references (the compiled CPU decode kernel off: test_cpu_decode.py has it)."""
    monkeypatch.setattr(api.cpu_decode, "supports", lambda q, k_cache: False)
    gen = torch.Generator().manual_seed(21)
    case, q, cu = _batch(gen, chunks, 8, 2, 64, 16)
    names = ("paged_decode_triton", "paged_prefill_triton") if use_triton else \
        ("paged_decode_reference", "paged_prefill_reference")
    spies = [_Spy(getattr(api, n)) for n in names]
    for n, spy in zip(names, spies):
        monkeypatch.setattr(api, n, spy)
    out = nan_like(q.shape, q.dtype, q.device)
    paged_attention(q, case.k_cache, case.v_cache, cu, case.seq_lens, case.block_tables, 0.125, out=out,
                    use_triton=use_triton)
    assert (spies[0].calls, spies[1].calls) == ((1, 0) if expect_decode else (0, 1))
    assert_close_to_oracle(out, _oracle(case, q, cu, 0.125), torch.float32)


def test_max_query_len_hint_selects_prefill_for_empty_chunks(monkeypatch):
    """total tokens == num_seqs but one chunk is empty: the hint max_query_len=2 keeps it on prefill."""
    gen = torch.Generator().manual_seed(22)
    case, q, cu = _batch(gen, ((5, 0), (7, 2)), 4, 2, 64, 16)
    spy = _Spy(api.paged_prefill_triton)
    monkeypatch.setattr(api, "paged_prefill_triton", spy)
    out = paged_attention(q, case.k_cache, case.v_cache, cu, case.seq_lens, case.block_tables, 0.125,
                          max_query_len=2, use_triton=True, validate_values=False)
    assert spy.calls == 1
    assert_close_to_oracle(out, _oracle(case, q, cu, 0.125), torch.float32)


@pytest.mark.parametrize("alibi,window", [(False, None), (True, 9)])
def test_reference_batching_with_tiny_budget(monkeypatch, alibi, window):
    """Force many gather groups (decode) and many query blocks (prefill): results must not change."""
    monkeypatch.setattr(reference, "GATHER_BUDGET_BYTES", 4096)
    gen = torch.Generator().manual_seed(23)
    device = kernel_device()
    slopes = alibi_like_slopes(6, device) if alibi else None
    case, q, cu = _batch(gen, ((30, 1), (0, 1), (60, 1), (12, 1), (3, 1)), 6, 2, 32, 8)
    out = paged_decode(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.2, slopes, window,
                       use_triton=False)
    assert_close_to_oracle(out, _oracle(case, q, cu, 0.2, slopes, window), torch.float32)
    case, q, cu = _batch(gen, ((20, 45), (0, 1), (0, 33)), 6, 2, 32, 8)
    out = paged_prefill(q, case.k_cache, case.v_cache, cu, case.seq_lens, case.block_tables, 0.2, slopes,
                        sliding_window=window, use_triton=False)
    assert_close_to_oracle(out, _oracle(case, q, cu, 0.2, slopes, window), torch.float32)


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "reference"])
def test_store_then_chunked_prefill_then_decode(use_triton):
    """The engine's sequence of calls: store a prompt in two chunks (attending after each), then decode,
    all through the public API; every step matches attention over the full logical history."""
    gen = torch.Generator().manual_seed(24)
    device = kernel_device()
    q_heads, kv_heads, head_dim, block_size = 4, 2, 64, 8
    k_cache = torch.randn((10, block_size, kv_heads, head_dim), generator=gen).to(device)
    v_cache = torch.randn_like(k_cache)
    table = torch.tensor([[7, 2, 9, 0, 4]], dtype=torch.int32, device=device)
    keys = torch.randn((30, kv_heads, head_dim), generator=gen).to(device)
    values = torch.randn((30, kv_heads, head_dim), generator=gen).to(device)
    queries = torch.randn((30, q_heads, head_dim), generator=gen).to(device)
    scale = 1 / math.sqrt(head_dim)
    for start, end in ((0, 13), (13, 29), (29, 30)):
        slots = torch.tensor([int(table[0, p // block_size]) * block_size + p % block_size
                              for p in range(start, end)], device=device)
        store_kv(keys[start:end], values[start:end], k_cache, v_cache, slots, use_triton=use_triton)
        cu = torch.tensor([0, end - start], dtype=torch.int32, device=device)
        seq_lens = torch.tensor([end], dtype=torch.int32, device=device)
        out = paged_attention(queries[start:end], k_cache, v_cache, cu, seq_lens, table, scale,
                              use_triton=use_triton)
        expected = dense_attention(queries[start:end], keys[:end], values[:end], scale)
        assert_close_to_oracle(out, expected, torch.float32)


@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "reference"])
@pytest.mark.parametrize("chunks", [((9, 1), (30, 1)), ((9, 4), (0, 6))], ids=["decode", "prefill"])
def test_query_sliced_from_fused_projection(use_triton, chunks):
    """q as a view into a fused [tokens, (Hq + 2 Hkv), D] projection (token stride > Hq * D)."""
    gen = torch.Generator().manual_seed(25)
    case, q, cu = _batch(gen, chunks, 4, 2, 64, 16)
    fused = torch.randn((q.shape[0], 8, 64), generator=gen).to(q.device)
    fused[:, :4] = q
    q_view = fused[:, :4]
    assert not q_view.is_contiguous()
    out = paged_attention(q_view, case.k_cache, case.v_cache, cu, case.seq_lens, case.block_tables, 0.125,
                          use_triton=use_triton)
    assert_close_to_oracle(out, _oracle(case, q, cu, 0.125), torch.float32)
