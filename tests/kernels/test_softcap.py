"""Attention logit soft-capping (Gemma 2: scores = cap * tanh(scale * q k / cap)) in every attention path,
against the float64 oracle (``dense_attention(..., softcap=)``) on random inputs scattered into shuffled
blocks: the torch references (decode and prefill), the CPU decode kernel (``cpu_decode.c``, also through
``store_kv_and_attend``), and the Triton decode and prefill kernels (under the interpreter on CPU). A cap
small enough to bind (scores of a few units against a cap of 2) so that a path that skipped it would fail."""

from __future__ import annotations

import pytest
import torch
from helpers.paged_kv_cases import assert_close_to_oracle, dense_attention, make_paged_case, seed_of
from pagedray import kernels
from pagedray.kernels.cpu import cpu_decode

CAP, SCALE = 2.0, 0.5
F32 = torch.float32


def _decode_case(seed: int, lens=(1, 17, 40, 33), q_heads=4, kv_heads=2, head_dim=32, dtype=F32):
    gen = torch.Generator().manual_seed(seed)
    case = make_paged_case(gen, list(lens), kv_heads, head_dim, 16, dtype, torch.device("cpu"))
    q = torch.randn((len(lens), q_heads, head_dim), generator=gen).to(dtype)
    want = torch.stack([dense_attention(q[i:i + 1], case.keys[i], case.values[i], SCALE, softcap=CAP)[0]
                        for i in range(len(lens))])
    plain = torch.stack([dense_attention(q[i:i + 1], case.keys[i], case.values[i], SCALE)[0]
                         for i in range(len(lens))])
    assert (want - plain).abs().max() > 0.05                 # the cap binds on these inputs
    return case, q, want


@pytest.mark.parametrize("path", ["reference", "cpu_kernel", "triton"])
def test_decode_soft_caps_the_scores(path):
    case, q, want = _decode_case(seed_of("softcap-decode", path))
    if path == "reference":
        got = kernels.paged_decode_reference(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, SCALE,
                                             logit_softcap=CAP)
    elif path == "cpu_kernel":
        if not cpu_decode.available():
            pytest.skip("no C compiler to build the CPU kernel")
        got = kernels.paged_decode(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, SCALE,
                                   logit_softcap=CAP)
    else:
        got = kernels.paged_decode(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, SCALE,
                                   logit_softcap=CAP, use_triton=True)
    assert_close_to_oracle(got, want, F32)


@pytest.mark.parametrize("use_triton", [False, True])
def test_prefill_soft_caps_the_scores(use_triton):
    gen = torch.Generator().manual_seed(seed_of("softcap-prefill", use_triton))
    lens, chunks = [40, 23], [12, 23]                          # a chunk over a history, and a fresh prompt
    case = make_paged_case(gen, lens, 2, 32, 16, F32, torch.device("cpu"))
    q = torch.randn((sum(chunks), 4, 32), generator=gen)
    cu = torch.tensor([0, chunks[0], sum(chunks)], dtype=torch.int32)
    got = kernels.paged_prefill(q, case.k_cache, case.v_cache, cu, case.seq_lens, case.block_tables, SCALE,
                                logit_softcap=CAP, use_triton=use_triton)
    want = torch.cat([dense_attention(q[cu[i]:cu[i + 1]], case.keys[i], case.values[i], SCALE, softcap=CAP)
                      for i in range(2)])
    assert_close_to_oracle(got, want, F32)


def test_the_one_call_decode_layer_soft_caps_too():
    if not cpu_decode.available():
        pytest.skip("no C compiler to build the CPU kernel")
    case, q, want = _decode_case(seed_of("softcap-store"))
    n = q.shape[0]
    last = case.seq_lens.long() - 1
    slots = (case.block_tables.long().gather(1, (last // 16)[:, None])[:, 0] * 16 + last % 16).to(torch.int32)
    key = case.k_cache.view(-1, 2, 32)[slots.long()].clone()   # the stored rows themselves: the same cache after
    value = case.v_cache.view(-1, 2, 32)[slots.long()].clone()
    got = kernels.store_kv_and_attend(q, key, value, case.k_cache, case.v_cache, slots, torch.arange(n + 1,
                                      dtype=torch.int32), case.seq_lens, case.block_tables, SCALE, max_query_len=1,
                                      logit_softcap=CAP)
    assert_close_to_oracle(got, want, F32)


@pytest.mark.parametrize("cap", [0.0, -1.0, float("inf"), True])
def test_a_bad_cap_is_a_value_error_naming_it(cap):
    case, q, _ = _decode_case(1)
    with pytest.raises(ValueError, match="logit_softcap"):
        kernels.paged_decode(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, SCALE,
                             logit_softcap=cap)
