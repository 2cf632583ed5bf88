"""FreeBlockQueue and BlockPool: exact block ids, eviction order, ref counts, errors."""

import pytest
from pagedray.block_manager import BlockKey, BlockPool, CannotAllocateError, DoubleFreeError, FreeBlockQueue


def test_queue_starts_in_id_order_and_pops_from_head():
    queue = FreeBlockQueue(4)
    assert list(queue) == [0, 1, 2, 3]
    assert queue.popleft() == 0
    assert queue.popleft() == 1
    assert list(queue) == [2, 3] and len(queue) == 2


def test_queue_append_goes_to_tail_and_remove_unlinks_middle():
    queue = FreeBlockQueue(5)
    assert [queue.popleft() for _ in range(5)] == [0, 1, 2, 3, 4]
    assert len(queue) == 0 and list(queue) == []
    for block_id in (3, 0, 4, 1):
        queue.append(block_id)
    queue.remove(0)  # middle
    assert list(queue) == [3, 4, 1]
    queue.remove(3)  # head
    queue.remove(1)  # tail
    assert list(queue) == [4] and len(queue) == 1
    queue.append(2)
    assert list(queue) == [4, 2]
    assert queue.popleft() == 4


def test_single_block_queue():
    queue = FreeBlockQueue(1)
    assert queue.popleft() == 0 and len(queue) == 0
    queue.append(0)
    assert list(queue) == [0]


def test_pool_allocates_head_first_and_release_appends_to_tail():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert pool.num_free_blocks == 1 and pool.usage == pytest.approx(0.75)
    pool.release(1)
    pool.release(0)
    assert pool.free_block_ids() == [3, 1, 0]
    assert pool.allocate(2) == [3, 1]
    pool.check_invariants()


def test_touch_revives_cached_free_block_from_middle_of_queue():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    key = BlockKey(None, (7, 8))
    assert pool.cache(blocks[2], key) is key
    for block_id in blocks:
        pool.release(block_id)
    assert pool.free_block_ids() == [0, 1, 2, 3]
    assert pool.lookup(BlockKey(None, (7, 8))) == 2  # freed but still findable
    pool.touch(2)
    assert pool.free_block_ids() == [0, 1, 3]
    assert pool.ref_count(2) == 1
    pool.touch(2)
    assert pool.ref_count(2) == 2
    pool.check_invariants()


def test_reallocating_a_cached_free_block_evicts_its_key():
    pool = BlockPool(2)
    first, second = pool.allocate(2)
    pool.cache(first, BlockKey(None, (1,)))
    pool.cache(second, BlockKey(None, (2,)))
    pool.release(second)
    pool.release(first)  # queue: [second, first]
    assert pool.allocate(1) == [second]
    assert pool.lookup(BlockKey(None, (2,))) is None
    assert pool.lookup(BlockKey(None, (1,))) == first
    assert pool.num_evictions == 1 and pool.num_cached_blocks == 1
    pool.check_invariants()


def test_duplicate_key_keeps_first_block_and_returns_canonical_key():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    key_a = BlockKey(None, (5, 5))
    assert pool.cache(a, key_a) is key_a
    assert pool.cache(b, BlockKey(None, (5, 5))) is key_a
    assert pool.key_of(b) is None and pool.lookup(key_a) == a


def test_allocate_past_capacity_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(CannotAllocateError, match=r"cannot allocate 2 block\(s\): only 1 free"):
        pool.allocate(2)
    assert pool.free_block_ids() == [2] and pool.ref_count(2) == 0


def test_release_of_free_block_is_double_free():
    pool = BlockPool(2)
    (block_id,) = pool.allocate(1)
    pool.release(block_id)
    with pytest.raises(DoubleFreeError, match="block 0"):
        pool.release(block_id)
    assert pool.free_block_ids() == [1, 0]


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_pool_rejects_bad_size(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(bad)


def test_ref_count_rejects_out_of_range_block():
    with pytest.raises(ValueError, match="block_id"):
        BlockPool(2).ref_count(2)
