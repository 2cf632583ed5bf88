"""The CPU prefill-attention kernel (``kernels/cpu/cpu_prefill.c``) against the float64 dense oracle on random
inputs: tile edges for each group size, histories, sliding windows, head sizes and block sizes, strided q;
what it refuses; and the CPU dispatch that sends chunks of 2+ tokens to it and single tokens to the decode
kernel."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.paged_kv_cases import assert_close_to_oracle, dense_attention, make_paged_case, seed_of
from helpers.spies import record_calls
from pagedray import kernels
from pagedray.kernels.cpu import cpu_decode, cpu_prefill

F32, BF16 = torch.float32, torch.bfloat16
pytestmark = pytest.mark.skipif(cpu_prefill._library() is None, reason="no C compiler to build cpu_prefill.c")

# (q_heads, kv_heads, head_dim, block_size, dtype, ((history, q_len), ...), window)
CASES = [
    (4, 4, 64, 16, F32, ((0, 47), (0, 48), (0, 49), (3, 2)), None),        # G 1: tiles of 48 tokens
    (9, 3, 64, 16, BF16, ((0, 15), (0, 16), (0, 17), (40, 100)), None),     # G 3: tiles of 16
    (16, 2, 128, 8, F32, ((0, 5), (0, 6), (0, 7), (300, 13)), None),        # G 8: tiles of 6
    (4, 2, 96, 64, F32, ((130, 70), (0, 2), (64, 64)), 33),                 # window, history, 6 x 16 dims
    (64, 1, 64, 16, BF16, ((5, 3), (0, 9)), None),                          # G 64: one token per tile
    (2, 1, 256, 32, BF16, ((17, 40), (1, 65)), 8),                          # head_dim 256, short window
    (3, 1, 64, 16, F32, ((0, 600), (100, 300)), None),                      # long chunks: 10+ key chunks
    (3, 1, 64, 16, BF16, ((0, 600), (100, 301)), None),                     # the same in bf16 (pairs of keys)
    (4, 4, 80, 8, BF16, ((0, 33), (7, 1), (0, 2)), 5),                      # bf16: 5 x 16 dims, odd key counts
]


def _case_id(case) -> str:
    q_heads, kv_heads, head_dim, block_size, dtype, chunks, window = case
    return f"g{q_heads // kv_heads}-d{head_dim}-b{block_size}-{str(dtype)[6:]}-w{window}"


def _inputs(case, seed: int, strided_q: bool = False):
    q_heads, kv_heads, head_dim, block_size, dtype, chunks, window = case
    gen = torch.Generator().manual_seed(seed)
    k_lens, q_lens = [h + n for h, n in chunks], [n for _, n in chunks]
    paged = make_paged_case(gen, k_lens, kv_heads, head_dim, block_size, dtype, torch.device("cpu"))
    rows = torch.randn((sum(q_lens), q_heads + 2 * kv_heads, head_dim), generator=gen).to(dtype)
    q = rows[:, :q_heads] if strided_q else rows[:, :q_heads].contiguous()      # [T, Hq, D]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, paged, cu, 1.0 / math.sqrt(head_dim), window


def _oracle(q, paged, cu, scale, window) -> torch.Tensor:
    starts = cu.tolist()
    return torch.cat([dense_attention(q[starts[i]:starts[i + 1]], paged.keys[i], paged.values[i], scale, None,
                                      window) for i in range(len(starts) - 1)])


@pytest.mark.parametrize("strided_q", [False, True], ids=["contiguous", "qkv-slice"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernel_matches_dense_oracle(case, strided_q):
    q, paged, cu, scale, window = _inputs(case, seed_of(_case_id(case), strided_q), strided_q)
    assert cpu_prefill.supports(q, paged.k_cache)
    out = cpu_prefill.paged_prefill_cpu(q, paged.k_cache, paged.v_cache, cu, paged.seq_lens, paged.block_tables,
                                        scale, window)
    assert out.shape == q.shape and out.is_contiguous()
    assert_close_to_oracle(out, _oracle(q, paged, cu, scale, window), case[4])


BF16_CASES = [case for case in CASES if case[4] == BF16]


@pytest.mark.parametrize("case", BF16_CASES, ids=_case_id)
def test_bf16_items_match_the_oracle_with_and_without_the_amx_tiles(case):
    """Both bf16 item kinds (AMX tiles where the CPU has them, the AVX-512 / generic items) stay at the output's
    bf16 rounding; where AMX runs, heads of a multiple of 32 take it (rows in items of 192 at head_dim 64)."""
    q, paged, cu, scale, window = _inputs(case, seed_of("amx", _case_id(case)))
    oracle = _oracle(q, paged, cu, scale, window)
    for amx in (True, False):
        out = cpu_prefill.paged_prefill_cpu(q, paged.k_cache, paged.v_cache, cu, paged.seq_lens,
                                            paged.block_tables, scale, window, amx=amx)
        assert_close_to_oracle(out, oracle, BF16)


@pytest.mark.skipif(not cpu_prefill.amx_items(), reason="no AMX tiles on this CPU / kernel / compiler")
def test_the_amx_items_run_where_the_cpu_has_them():
    """A long bf16 chunk (600 tokens: many 64-key chunks, items of 64 tokens) through the tiles and through
    the AVX-512 items: both close to the oracle, and not the same bits (the tile products add in another
    order), so the tile path did run."""
    case = (3, 1, 64, 16, BF16, ((0, 600), (100, 301)), None)
    q, paged, cu, scale, window = _inputs(case, 11)
    args = (q, paged.k_cache, paged.v_cache, cu, paged.seq_lens, paged.block_tables, scale, window)
    tiles, vectors = cpu_prefill.paged_prefill_cpu(*args, amx=True), cpu_prefill.paged_prefill_cpu(*args, amx=False)
    oracle = _oracle(q, paged, cu, scale, window)
    assert_close_to_oracle(tiles, oracle, BF16)
    assert_close_to_oracle(vectors, oracle, BF16)
    assert not torch.equal(tiles, vectors)


def test_refuses_what_it_does_not_compute():
    q, cache = torch.randn(3, 4, 64), torch.randn(2, 16, 2, 64)
    assert cpu_prefill.supports(q, cache)
    assert not cpu_prefill.supports(q, cache, alibi_slopes=torch.ones(4))
    assert not cpu_prefill.supports(q, cache, logit_softcap=30.0)
    assert not cpu_prefill.supports(q.half(), cache.half())                  # float16: the reference
    assert not cpu_prefill.supports(q, cache.to(torch.int8))                  # 8-bit cache: decode rows
    assert not cpu_prefill.supports(torch.randn(3, 4, 40), torch.randn(2, 16, 2, 40))   # head_dim % 16
    assert not cpu_prefill.supports(q, torch.randn(2, 12, 2, 64))             # block_size % 8


def test_cpu_path_sends_chunks_to_it_and_single_tokens_to_the_decode_kernel(monkeypatch):
    def query_rows(name, args):
        return args[0].shape[0]

    prefill_rows = record_calls(monkeypatch, cpu_prefill, ["paged_prefill_cpu"], query_rows)
    decode_rows = record_calls(monkeypatch, cpu_decode, ["paged_decode_cpu"], query_rows)
    case = (6, 2, 64, 16, F32, ((0, 30), (12, 1), (4, 5)), None)
    q, paged, cu, scale, window = _inputs(case, 7)
    out = kernels.paged_prefill(q, paged.k_cache, paged.v_cache, cu, paged.seq_lens, paged.block_tables, scale)
    assert prefill_rows == [35] and decode_rows == [1]     # chunks of 30 and 5 tokens; one single token
    assert_close_to_oracle(out, _oracle(q, paged, cu, scale, window), F32)
    prefill_rows.clear()
    decode_rows.clear()
    only_chunks = torch.tensor([0, 30, 35], dtype=torch.int32)                # one call, no gather
    kernels.paged_prefill(q[:35], paged.k_cache, paged.v_cache, only_chunks, paged.seq_lens[[0, 2]],
                          paged.block_tables[[0, 2]], scale)
    assert prefill_rows == [35] and decode_rows == []
