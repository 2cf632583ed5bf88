"""Attention sinks (gpt-oss: one learned logit per query head joins each softmax and takes probability from
the keys without adding a value) in every attention path, against the float64 oracle
(``dense_attention(..., sinks=)``) on random inputs scattered into shuffled blocks: the torch references
(decode and prefill, also with a sliding window), the CPU decode kernel (``cpu_decode.c``, also through
``store_kv_and_attend``'s one call and as the prefill's decode rows), and the Triton decode (with and without
split-KV) and prefill kernels (under the interpreter on CPU). The sinks are of the scores' size, so a path that
skipped them would be off by far more than the tolerance (asserted on each case)."""

from __future__ import annotations

import pytest
import torch
from helpers.paged_kv_cases import assert_close_to_oracle, dense_attention, make_paged_case, seed_of
from pagedray import kernels
from pagedray.kernels.cpu import cpu_decode
from pagedray.kernels.triton.decode_triton import paged_decode_triton

SCALE = 0.5
F32 = torch.float32
Q_HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32


def _sinks(gen) -> torch.Tensor:
    return (torch.randn(Q_HEADS, generator=gen) * 2.0).to(F32)          # [Hq], about the scores' size


def _oracle(q, case, chunks, sinks, window=None):
    return torch.cat([dense_attention(q[a:b], case.keys[i], case.values[i], SCALE, sliding_window=window,
                                      sinks=sinks) for i, (a, b) in enumerate(chunks)])


def _decode_case(seed: int, lens=(1, 17, 40, 33)):
    gen = torch.Generator().manual_seed(seed)
    case = make_paged_case(gen, list(lens), KV_HEADS, HEAD_DIM, 16, F32, torch.device("cpu"))
    q = torch.randn((len(lens), Q_HEADS, HEAD_DIM), generator=gen)
    sinks = _sinks(gen)
    chunks = [(i, i + 1) for i in range(len(lens))]
    want = _oracle(q, case, chunks, sinks)
    plain = torch.cat([dense_attention(q[a:b], case.keys[i], case.values[i], SCALE) for i, (a, b) in enumerate(chunks)])
    assert (want - plain).abs().max() > 0.05                 # the sinks matter on these inputs
    return case, q, sinks, want


@pytest.mark.parametrize("path", ["reference", "cpu_kernel", "triton", "triton_split"])
def test_decode_adds_the_sinks(path):
    case, q, sinks, want = _decode_case(seed_of("sinks-decode", path))
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, SCALE)
    if path == "reference":
        got = kernels.paged_decode_reference(*args, sinks=sinks)
    elif path == "cpu_kernel":
        if not cpu_decode.available():
            pytest.skip("no C compiler to build the CPU kernel")
        got = kernels.paged_decode(*args, sinks=sinks)
    elif path == "triton":
        got = kernels.paged_decode(*args, sinks=sinks, use_triton=True)
    else:                                                     # the sink joins once, in the split reduction
        got = paged_decode_triton(*args, sinks=sinks, num_splits=3)
    assert_close_to_oracle(got, want, F32)


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("window", [None, 9])
def test_prefill_adds_the_sinks(use_triton, window):
    gen = torch.Generator().manual_seed(seed_of("sinks-prefill", use_triton, window))
    lens, chunks = [40, 23, 9], [12, 23, 1]                   # over a history, a fresh prompt, a decode row
    case = make_paged_case(gen, lens, KV_HEADS, HEAD_DIM, 16, F32, torch.device("cpu"))
    q = torch.randn((sum(chunks), Q_HEADS, HEAD_DIM), generator=gen)
    sinks = _sinks(gen)
    cu = [0, chunks[0], chunks[0] + chunks[1], sum(chunks)]
    got = kernels.paged_prefill(q, case.k_cache, case.v_cache, torch.tensor(cu, dtype=torch.int32), case.seq_lens,
                                case.block_tables, SCALE, sliding_window=window, sinks=sinks, use_triton=use_triton)
    assert_close_to_oracle(got, _oracle(q, case, list(zip(cu, cu[1:])), sinks, window), F32)


def test_the_one_call_decode_adds_the_sinks_too():
    if not cpu_decode.available():
        pytest.skip("no C compiler to build the CPU kernel")
    case, q, sinks, want = _decode_case(seed_of("sinks-store"))
    n = q.shape[0]
    last = case.seq_lens.long() - 1
    slots = (case.block_tables.long().gather(1, (last // 16)[:, None])[:, 0] * 16 + last % 16).to(torch.int32)
    key = case.k_cache.view(-1, KV_HEADS, HEAD_DIM)[slots.long()].clone()   # the stored rows: the same cache after
    value = case.v_cache.view(-1, KV_HEADS, HEAD_DIM)[slots.long()].clone()
    got = kernels.store_kv_and_attend(q, key, value, case.k_cache, case.v_cache, slots,
                                      torch.arange(n + 1, dtype=torch.int32), case.seq_lens, case.block_tables,
                                      SCALE, max_query_len=1, sinks=sinks)
    assert_close_to_oracle(got, want, F32)


@pytest.mark.parametrize("bad, match", [(torch.zeros(3), r"\[4\]"), (torch.zeros(4, dtype=torch.float64), "float32"),
                                        (torch.zeros(8)[::2], "contiguous")])
def test_bad_sinks_are_a_value_error_naming_them(bad, match):
    case, q, _, _ = _decode_case(1)
    with pytest.raises(ValueError, match=f"sinks.*{match}"):
        kernels.paged_decode(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, SCALE, sinks=bad)
