"""``kernels.store_kv_and_attend``: ``store_kv`` then ``paged_attention`` in one call (the CPU decode kernel
stores each sequence's new key / value itself, then reads them), against the two calls of the torch
references on the same random inputs: the cache afterwards (every slot, junk included) and the output.

Random keys and values scattered into shuffled blocks among junk (``make_paged_case``), the new token at
each sequence's last position, odd lengths, GQA and MQA, a sliding window, float32 and bfloat16, many
sequences (one work item per sequence) and few (one per KV head), a padded row (slot -1: nothing
stored), and a step that is not all decode (the two calls)."""

from __future__ import annotations

import pytest
import torch
from helpers.paged_kv_cases import make_paged_case, seed_of
from pagedray.kernels import paged_attention_reference, store_kv_and_attend, store_kv_reference
from pagedray.kernels.cpu import cpu_decode

needs_kernel = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler to build the CPU kernel")
F32, BF16 = torch.float32, torch.bfloat16

# (q_heads, kv_heads, head_dim, block_size, dtype, seq_lens, window)
SPECS = [
    (9, 3, 64, 16, F32, (1, 16, 17, 250, 301, 33, 5), None),     # SmolLM2's heads, an item per sequence
    (9, 3, 64, 16, BF16, (1, 16, 17, 250, 301, 33, 5), None),
    (8, 2, 128, 32, BF16, (300, 7), 50),                         # two sequences: an item per KV head
    (4, 1, 32, 8, F32, (3, 9, 100, 64), 4),                      # MQA, a window shorter than a block
]


def _step(spec, seed: int, pad_last: bool = False):
    q_heads, kv_heads, head_dim, block_size, dtype, lens, window = spec
    gen = torch.Generator().manual_seed(seed)
    case = make_paged_case(gen, list(lens), kv_heads, head_dim, block_size, dtype, torch.device("cpu"))
    case.block_tables[case.block_tables >= case.k_cache.shape[0]] = 0   # padding columns: a real block id
    n = len(lens)
    q = torch.randn((n, q_heads, head_dim), generator=gen).to(dtype)
    key = torch.randn((n, kv_heads, head_dim), generator=gen).to(dtype)
    value = torch.randn((n, kv_heads, head_dim), generator=gen).to(dtype)
    last = torch.tensor(lens) - 1
    blocks = case.block_tables.long().gather(1, (last // block_size)[:, None])[:, 0]
    slots = blocks * block_size + last % block_size                          # each sequence's last position
    if pad_last:
        slots[-1] = -1
    cu = torch.arange(n + 1, dtype=torch.int32)
    return case, q, key, value, slots, cu, window


@needs_kernel
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s[0]}q{s[1]}kv{s[2]}d{s[3]}b-{s[4]}-w{s[6]}")
@pytest.mark.parametrize("pad_last", [False, True])
def test_one_call_equals_store_then_attend(spec, pad_last):
    case, q, key, value, slots, cu, window = _step(spec, seed_of("store-attend", spec, pad_last), pad_last)
    k_ref, v_ref = case.k_cache.clone(), case.v_cache.clone()
    store_kv_reference(key, value, k_ref, v_ref, slots)
    want = paged_attention_reference(q, k_ref, v_ref, cu, case.seq_lens, case.block_tables, 0.125,
                                     sliding_window=window)
    k_got, v_got = case.k_cache.clone(), case.v_cache.clone()
    got = store_kv_and_attend(q, key, value, k_got, v_got, slots, cu, case.seq_lens, case.block_tables, 0.125,
                              max_query_len=1, sliding_window=window)
    assert torch.equal(k_got, k_ref) and torch.equal(v_got, v_ref)            # the same slots written
    tolerance = 2e-2 if q.dtype == BF16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=tolerance)
    assert not torch.equal(case.k_cache, k_got) or pad_last and len(slots) == 1   # the call did store


def test_a_mixed_step_takes_the_two_calls():
    spec = (4, 2, 32, 8, F32, (5, 9), None)
    case, q, key, value, slots, cu, _ = _step(spec, seed_of("mixed"))
    q2 = torch.cat([q, q[:1]])                       # sequence 0 gets a 2-token chunk: not all decode
    key2, value2 = torch.cat([key, key[:1]]), torch.cat([value, value[:1]])
    cu2 = torch.tensor([0, 2, 3], dtype=torch.int32)
    lens = case.seq_lens + torch.tensor([1, 0], dtype=torch.int32)
    blocks = case.block_tables.long()
    slots2 = torch.stack([slots[0], blocks[0, 5 // 8] * 8 + 5 % 8, slots[1]])
    k_ref, v_ref = case.k_cache.clone(), case.v_cache.clone()
    store_kv_reference(key2, value2, k_ref, v_ref, slots2)
    want = paged_attention_reference(q2, k_ref, v_ref, cu2, lens, case.block_tables, 0.2)
    got = store_kv_and_attend(q2, key2, value2, case.k_cache, case.v_cache, slots2, cu2, lens, case.block_tables,
                              0.2, max_query_len=2)
    assert torch.equal(case.k_cache, k_ref)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_bad_arguments_are_value_errors_naming_them():
    spec = (4, 2, 32, 8, F32, (5, 9), None)
    case, q, key, value, slots, cu, _ = _step(spec, seed_of("bad"))
    before = case.k_cache.clone()
    with pytest.raises(ValueError, match="value: 1 heads, expected num_kv_heads = 2"):
        store_kv_and_attend(q, key, value[:, :1], case.k_cache, case.v_cache, slots, cu, case.seq_lens,
                            case.block_tables, 0.2)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv_and_attend(q, key, value, case.k_cache, case.v_cache, slots + 10_000, cu, case.seq_lens,
                            case.block_tables, 0.2)
    assert torch.equal(case.k_cache, before)                                  # nothing written
