"""The host-memory second tier (``kv_host_tier.py``; CUDA's default, driven here on CPU caches): saved blocks come
back bit for bit into other blocks, a slot holds its block until loaded once, misses leave blocks untouched, and
the engine serves an evicted prefix from it with transformers' tokens. The CUDA path (pinned rows, side stream)
has ``-m gpu`` tests."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_oracle import hf_greedy
from helpers.tier_runs import small_kv_cache
from pagedray.workers.kv_host_tier import HostTierStore
from pagedray.workers.kv_tier import KVTierStore, open_tier_store


def _tensors(cache) -> list[torch.Tensor]:
    return [cache.data] + ([cache.scales] if cache.scales is not None else [])


@pytest.mark.parametrize("quantized", [False, True])
def test_saved_blocks_load_back_exactly_into_other_blocks(quantized):
    cache = small_kv_cache(quantized)
    store = HostTierStore(cache, num_slots=5)
    original = {b: [t[:, :, b].clone() for t in _tensors(cache)] for b in (1, 2)}
    store.save_many([(2, 4), (1, 0)])
    for t in _tensors(cache):
        t[:, :, 1:3].zero_()                                       # the blocks get new owners
    loaded, seconds = store.load_many([(0, 5), (4, 3)])
    assert loaded == [True, True] and seconds >= 0
    for t, before1, before2 in zip(_tensors(cache), original[1], original[2]):
        assert torch.equal(t[:, :, 5], before1) and torch.equal(t[:, :, 3], before2)


def test_a_slot_loads_once_and_misses_leave_the_block_untouched():
    cache = small_kv_cache(False)
    store = HostTierStore(cache, num_slots=3)
    store.save(0, 1)
    before = cache.data[:, :, 4].clone()
    loaded, _ = store.load_many([(2, 4), (1, 5)])                 # slot 2 never saved: a miss
    assert loaded == [False, True]
    assert torch.equal(cache.data[:, :, 4], before)
    assert store.load(1, 4) is False                              # slot 1 was consumed by its load
    assert torch.equal(cache.data[:, :, 4], before)
    store.save(3, 1)                                              # a slot is reused by a later save
    assert store.load(1, 4) and torch.equal(cache.data[:, :, 4], cache.data[:, :, 3])


def test_bad_slots_and_sizes_are_refused_naming_the_option():
    cache = small_kv_cache(False)
    with pytest.raises(ValueError, match="kv_offload_gib"):
        HostTierStore(cache, num_slots=0)
    store = HostTierStore(cache, num_slots=2)
    with pytest.raises(ValueError, match="outside the host tier"):
        store.save_many([(0, 2)])
    with pytest.raises(ValueError, match="outside the host tier"):
        store.load_many([(-1, 0)])


def test_the_tier_is_files_on_cpu_or_with_a_folder(tmp_path):
    store = open_tier_store(small_kv_cache(False), None, rank=0, num_slots=4)
    assert isinstance(store, KVTierStore)                          # a CPU cache: files (the first tier is host memory)
    store.close()
    store = open_tier_store(small_kv_cache(False), str(tmp_path), rank=0, num_slots=4)
    assert isinstance(store, KVTierStore)
    store.close()


def test_the_engine_serves_an_evicted_prefix_from_the_host_tier(tiny_llama_path, tiny_hf_model, monkeypatch):
    from helpers.tier_runs import NEW, evict_then_return
    from pagedray.cluster import LLM

    opened = []

    def host_tier(kv_cache, folder, rank, num_slots):
        opened.append(HostTierStore(kv_cache, num_slots))
        return opened[-1]

    monkeypatch.setattr("pagedray.workers.worker.open_tier_store", host_tier)
    with LLM(tiny_llama_path, dtype="float32", block_size=8, num_blocks=16, watermark=0.0, threads_per_worker=1,
             kv_offload_gib=0.002) as llm:
        again, tokens, cached = evict_then_return(llm.engine)
        stats = llm.engine.block_manager.stats()
    assert len(opened) == 1 and opened[0].rows.shape[0] > 0
    assert cached == 32 and stats.num_tier_loaded == 4 and stats.num_tier_load_failures == 0
    assert tokens == hf_greedy(tiny_hf_model, again, NEW)


@pytest.mark.gpu
@pytest.mark.parametrize("quantized", [False, True])
def test_cuda_host_tier_is_pinned_and_exact(quantized):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cache = small_kv_cache(quantized, "cuda")
    store = open_tier_store(cache, None, rank=0, num_slots=4)
    assert isinstance(store, HostTierStore) and store.rows.is_pinned()
    original = [t[:, :, 2].clone() for t in _tensors(cache)]
    store.save_many([(2, 3)])
    for t in _tensors(cache):
        t[:, :, 2].fill_(7)                                        # queued after the save's gather: must not leak in
    loaded, seconds = store.load_many([(3, 0)])
    torch.cuda.synchronize()
    assert loaded == [True] and seconds > 0
    for t, before in zip(_tensors(cache), original):
        assert torch.equal(t[:, :, 0], before)
    store.close()
