"""A rank's second-tier store: a saved block comes back bit for bit (bf16, and int8 rows with their scales), and
a corrupt, short or missing file is a failed load that leaves the block as it was."""

import pytest
import torch
from helpers.tier_runs import small_kv_cache
from pagedray.workers.kv_tier import KVTierStore


@pytest.mark.parametrize("quantized", [False, True])
def test_a_saved_block_loads_back_exactly(tmp_path, quantized):
    cache = small_kv_cache(quantized)
    store = KVTierStore(cache, str(tmp_path), rank=1)
    tensors = [cache.data] + ([cache.scales] if quantized else [])
    original = [t[:, :, 2].clone() for t in tensors]
    store.save(2, 7)
    for t in tensors:
        t[:, :, 2].zero_()
    assert store.load(7, 4)                                        # into another block
    for t, before in zip(tensors, original):
        assert torch.equal(t[:, :, 4], before)
    assert (tmp_path / "rank1" / "7.kv").stat().st_size == store.block_bytes
    store.close()
    assert not (tmp_path / "rank1").exists()


def test_corrupt_short_or_missing_files_are_failed_loads(tmp_path):
    cache = small_kv_cache(False)
    store = KVTierStore(cache, str(tmp_path), rank=0)
    for slot, block in ((0, 0), (1, 1), (2, 2)):
        store.save(block, slot)
    raw = bytearray((tmp_path / "rank0" / "0.kv").read_bytes())
    raw[100] ^= 0xFF
    (tmp_path / "rank0" / "0.kv").write_bytes(bytes(raw))
    (tmp_path / "rank0" / "1.kv").write_bytes(raw[:-2])
    (tmp_path / "rank0" / "2.kv").unlink()
    before = cache.data[:, :, 5].clone()
    assert [store.load(slot, 5) for slot in (0, 1, 2)] == [False, False, False]
    assert store.load(3, 5) is False                               # never saved
    assert torch.equal(cache.data[:, :, 5], before)


def test_the_default_folder_is_per_process_and_orphans_are_removed(tmp_path, monkeypatch):
    import os
    import tempfile

    from pagedray.workers import kv_tier

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    orphan = tmp_path / f"{kv_tier.DEFAULT_PREFIX}999999999"      # no such process
    (orphan / "rank0").mkdir(parents=True)
    store = KVTierStore(small_kv_cache(False), None, rank=0)
    assert not orphan.exists() and store.folder.parent.name == f"{kv_tier.DEFAULT_PREFIX}{os.getpid()}"
    store.save(1, 0)
    assert store.load(0, 2)
    store.close()
    assert not store.folder.parent.exists()


def test_a_save_the_disk_refuses_is_a_miss_not_a_failed_step(tmp_path):
    cache = small_kv_cache(False)
    store = KVTierStore(cache, str(tmp_path), rank=0)
    (store.folder / "3.kv").mkdir()                  # writing the slot's file fails (a directory is in the way)
    store.save(1, 3)
    assert store.load(3, 2) is False
    store.save(1, 4)
    assert store.load(4, 2)
