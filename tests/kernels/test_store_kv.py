"""store_kv (Triton kernel, CPU C kernel and torch reference): new K/V land in exactly their slots, negative slots are
skipped, every other slot keeps its previous (random) contents."""

from __future__ import annotations

import pytest
import torch
from helpers.paged_kv_cases import kernel_device, seed_of
from pagedray.kernels import store_kv, store_kv_reference
from pagedray.kernels.cpu import cpu_fused


def _expected_cache(cache: torch.Tensor, new: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """Independent per-token loop: slot s -> block s // block_size, offset s % block_size."""
    expected = cache.clone()
    block_size = cache.shape[1]
    for token, slot in enumerate(slots):
        if slot >= 0:
            expected[slot // block_size, slot % block_size] = new[token]
    return expected


CASES = [
    # (num_tokens, num_kv_heads, head_dim, block_size, dtype, slot dtype)
    (13, 2, 64, 16, torch.float32, torch.int64),
    (7, 1, 96, 8, torch.float16, torch.int32),
    (20, 4, 128, 32, torch.float16, torch.int64),
    (9, 3, 64, 16, torch.float32, torch.int32),      # head count not a power of two (masked tile rows)
]


@pytest.mark.parametrize("impl", ["triton", "c", "reference"])
@pytest.mark.parametrize("num_tokens,kv_heads,head_dim,block_size,dtype,slot_dtype", CASES)
def test_store_kv_writes_only_mapped_slots(num_tokens, kv_heads, head_dim, block_size, dtype, slot_dtype,
                                           impl):
    device = kernel_device()
    gen = torch.Generator().manual_seed(seed_of(num_tokens, head_dim, impl))
    num_blocks = 6
    # One interleaved [num_layers, 2, ...] tensor like the workers' KV shard; layer 1's views.
    kv = torch.randn((2, 2, num_blocks, block_size, kv_heads, head_dim), generator=gen).to(dtype).to(device)
    k_cache, v_cache = kv[1, 0], kv[1, 1]
    # key/value as slices of a fused projection output (token stride > heads * head_dim).
    qkv = torch.randn((num_tokens, 3 * kv_heads, head_dim), generator=gen).to(dtype).to(device)
    key, value = qkv[:, kv_heads:2 * kv_heads], qkv[:, 2 * kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].tolist()
    for skipped in range(0, num_tokens, 3):
        slots[skipped] = -1
    slot_mapping = torch.tensor(slots, dtype=slot_dtype, device=device)
    expected_k = _expected_cache(k_cache.cpu(), key.cpu(), slots)
    expected_v = _expected_cache(v_cache.cpu(), value.cpu(), slots)
    layer0_before = kv[0].clone()

    if impl == "triton":
        store_kv(key, value, k_cache, v_cache, slot_mapping, use_triton=True, validate_values=True)
    elif impl == "c":
        if device.type != "cpu":
            pytest.skip("the C store is the CPU's")
        assert cpu_fused.supports_store_kv(key, value, k_cache, v_cache, slot_mapping)
        store_kv(key, value, k_cache, v_cache, slot_mapping, use_triton=False, validate_values=True)
    else:
        store_kv_reference(key, value, k_cache, v_cache, slot_mapping)

    assert torch.equal(k_cache.cpu(), expected_k)
    assert torch.equal(v_cache.cpu(), expected_v)
    assert torch.equal(kv[0], layer0_before)


@pytest.mark.parametrize("impl", ["triton", "c"])
def test_store_kv_all_slots_skipped_changes_nothing(impl):
    device = kernel_device()
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn((2, 16, 2, 64), generator=gen).to(device)
    v_cache = torch.randn((2, 16, 2, 64), generator=gen).to(device)
    before = (k_cache.clone(), v_cache.clone())
    key = torch.randn((4, 2, 64), generator=gen).to(device)
    slot_mapping = torch.full((4,), -1, dtype=torch.int64, device=device)
    store_kv(key, key.clone(), k_cache, v_cache, slot_mapping, use_triton=impl == "triton")
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_store_kv_large_gpu(dtype):
    gen = torch.Generator().manual_seed(9)
    num_blocks, block_size, kv_heads, head_dim, num_tokens = 512, 16, 8, 128, 3000
    k_cache = torch.randn((num_blocks, block_size, kv_heads, head_dim), generator=gen).to(dtype).cuda()
    v_cache = torch.randn_like(k_cache)
    key = torch.randn((num_tokens, kv_heads, head_dim), generator=gen).to(dtype).cuda()
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::7] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv_reference(key, value, expected_k, expected_v, slots.cuda())
    store_kv(key, value, k_cache, v_cache, slots.cuda(), validate_values=True)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
