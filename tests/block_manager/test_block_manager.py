"""BlockManager: exact block ids, prefix hits, eviction, slot mapping, watermark, errors.

Block size 4 throughout, so a prompt P of 10 tokens fills blocks [P0..P3], [P4..P7] and half of a
third block. Expected ids follow from the pool rules: a fresh pool hands out 0, 1, 2, ...; allocation
takes the head of the free queue; ``free`` releases a table last block first, to the tail.
"""

import pytest
from pagedray.block_manager import (
    BlockManager,
    BlockManagerError,
    CannotAllocateError,
    DoubleFreeError,
    UnknownSequenceError,
)

P = list(range(100, 110))  # 10 tokens


def snapshot(bm):
    """Everything observable about the manager's state."""
    seqs = {s: (bm.block_table(s), bm.num_slots(s)) for s in bm.sequence_ids()}
    refs = [bm.ref_count(b) for b in range(bm.num_blocks)]
    return seqs, refs, bm.pool.free_block_ids(), bm.pool.cached_keys(), bm.stats()


def test_fresh_manager_hands_out_blocks_in_order_and_grows_one_block_at_a_time():
    bm = BlockManager(4, 8)
    alloc = bm.allocate_slots("a", P, 10)
    assert (alloc.num_cached_tokens, alloc.new_block_ids) == (0, [0, 1, 2])
    assert bm.block_table("a") == [0, 1, 2] and bm.num_slots("a") == 10
    assert bm.num_free_blocks == 5 and bm.usage == pytest.approx(3 / 8)
    tokens = P + [1, 2, 3]
    assert bm.allocate_slots("a", tokens[:11], 1).new_block_ids == []
    assert bm.allocate_slots("a", tokens[:12], 1).new_block_ids == []
    assert bm.allocate_slots("a", tokens, 1).new_block_ids == [3]
    assert bm.block_table("a") == [0, 1, 2, 3] and bm.num_slots("a") == 13
    bm.check_invariants()


def test_chunked_prefill_and_interleaved_sequences_get_the_next_free_ids():
    bm = BlockManager(4, 8)
    assert bm.allocate_slots("a", P, 6).new_block_ids == [0, 1]
    assert bm.allocate_slots("b", P[:4], 4).new_block_ids == [2]
    assert bm.allocate_slots("a", P, 3).new_block_ids == [3]  # slots 6..8: fills block 1, opens 3
    assert bm.block_table("a") == [0, 1, 3]
    assert bm.slot_mapping("a", 0, 9) == [0, 1, 2, 3, 4, 5, 6, 7, 12]
    assert bm.slot_mapping("a", 3, 9) == [3, 4, 5, 6, 7, 12]
    assert bm.slot_mapping("a", 8, 9) == [12]
    assert bm.slot_mapping("a", 2, 2) == []
    assert bm.slot_mapping("b", 1, 3) == [9, 10]
    bm.check_invariants()


def test_prefix_hit_after_free_revives_cached_blocks_from_the_free_queue():
    bm = BlockManager(4, 6)
    bm.allocate_slots("a", P, 10)  # [0, 1, 2]; blocks 0 and 1 are full and cached
    bm.free("a")
    assert bm.pool.free_block_ids() == [3, 4, 5, 2, 1, 0]
    assert bm.num_free_blocks == 6 and all(bm.ref_count(b) == 0 for b in range(6))
    assert bm.num_cached_prefix_tokens(P) == 8
    alloc = bm.allocate_slots("b", P, 2)
    assert (alloc.num_cached_tokens, alloc.new_block_ids) == (8, [0, 1, 3])
    assert bm.num_slots("b") == 10
    assert bm.pool.free_block_ids() == [4, 5, 2]
    stats = bm.stats()
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (20, 8)
    assert stats.prefix_hit_rate == pytest.approx(0.4)
    bm.check_invariants()


def test_eviction_follows_the_free_queue_and_drops_only_the_reallocated_key():
    bm = BlockManager(4, 6)
    bm.allocate_slots("a", P, 10)
    bm.free("a")  # queue [3, 4, 5, 2, 1, 0]
    bm.allocate_slots("b", P, 2)  # takes 0, 1 from the queue and 3 from the head
    bm.free("b")  # queue [4, 5, 2, 3, 1, 0]
    other = list(range(500, 517))  # 17 tokens -> 5 blocks: 4, 5, 2, 3 and cached block 1
    assert bm.allocate_slots("c", other, 17).new_block_ids == [4, 5, 2, 3, 1]
    assert bm.stats().num_evictions == 1
    assert bm.num_cached_prefix_tokens(P) == 4  # block 0 still cached, block 1 evicted
    bm.check_invariants()


def test_lookup_always_leaves_one_token_to_compute():
    bm = BlockManager(4, 8)
    bm.allocate_slots("a", P[:8], 8)
    assert bm.num_cached_prefix_tokens(P[:8]) == 4
    assert bm.num_cached_prefix_tokens(P[:9]) == 8
    assert bm.num_cached_prefix_tokens(P[:4]) == 0
    assert bm.num_cached_prefix_tokens([]) == 0
    assert bm.num_cached_prefix_tokens(P[:4] + [0, 0, 0, 0, 0]) == 4
    alloc = bm.allocate_slots("b", P[:8], 4)
    assert alloc.num_cached_tokens == 4 and bm.block_table("b") == [0, 2]
    assert bm.ref_count(2) == 1 and bm.pool.key_of(2) is None  # duplicate content: not re-cached


def test_hash_collisions_never_alias_different_tokens():
    bm = BlockManager(4, 8)
    first = [-1] * 4 + [7] * 4 + [0]
    second = [-2] * 4 + [7] * 4 + [0]
    assert hash(tuple(first[:4])) == hash(tuple(second[:4]))  # a real CPython collision
    bm.allocate_slots("a", first, 9)
    assert bm.num_cached_prefix_tokens(second) == 0
    assert bm.num_cached_prefix_tokens(first) == 8
    assert bm.num_cached_prefix_tokens([-1] * 4 + [8] * 4 + [0]) == 4


def test_prefix_caching_off_never_hits_or_counts():
    bm = BlockManager(4, 8, enable_prefix_caching=False)
    bm.allocate_slots("a", P, 10)
    bm.free("a")
    assert bm.num_cached_prefix_tokens(P) == 0
    assert bm.allocate_slots("b", P, 10).num_cached_tokens == 0
    stats = bm.stats()
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens, stats.prefix_hit_rate) == (0, 0, 0.0)
    assert stats.num_cached_blocks == 0
    bm.check_invariants()


def test_fork_shares_full_blocks_and_copies_partial_last_block():
    bm = BlockManager(4, 8)
    bm.allocate_slots("a", P, 10)
    assert bm.fork("a", "b") == [(2, 3)]
    assert bm.block_table("b") == [0, 1, 3] and bm.num_slots("b") == 10
    assert [bm.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    # the children grow independently
    assert bm.allocate_slots("b", P + [1, 2, 3], 3).new_block_ids == [4]
    assert bm.allocate_slots("a", P + [9, 9], 2).new_block_ids == []
    bm.check_invariants()


def test_fork_of_block_aligned_sequence_copies_nothing():
    bm = BlockManager(4, 8)
    bm.allocate_slots("a", P[:8], 8)
    assert bm.fork("a", "b") == []
    assert bm.block_table("b") == [0, 1] and [bm.ref_count(b) for b in (0, 1)] == [2, 2]
    assert bm.allocate_slots("b", P[:9], 1).new_block_ids == [2]
    assert bm.allocate_slots("a", P[:8] + [5], 1).new_block_ids == [3]
    bm.free("a")
    assert [bm.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    bm.check_invariants()


def test_fork_errors_change_nothing():
    bm = BlockManager(4, 3)
    bm.allocate_slots("a", P, 10)  # uses every block; last block is partial
    before = snapshot(bm)
    with pytest.raises(CannotAllocateError, match=r"cannot allocate 1 block\(s\): only 0 free"):
        bm.fork("a", "b")
    with pytest.raises(ValueError, match="child_id"):
        bm.fork("a", "a")
    with pytest.raises(UnknownSequenceError):
        bm.fork("nope", "b")
    assert snapshot(bm) == before and "b" not in bm.sequence_ids()


def test_allocation_past_capacity_raises_and_changes_nothing():
    bm = BlockManager(4, 3)
    bm.allocate_slots("a", P, 10)
    before = snapshot(bm)
    with pytest.raises(CannotAllocateError, match=r"cannot allocate 1 block\(s\): only 0 free"):
        bm.allocate_slots("b", [1], 1)
    with pytest.raises(CannotAllocateError, match=r"cannot allocate 1 block\(s\): only 0 free"):
        bm.allocate_slots("a", P + [1, 2, 3], 3)
    assert not bm.can_allocate("a", P + [1, 2, 3], 3)
    assert bm.can_allocate("a", P + [1, 2], 2)
    assert snapshot(bm) == before and "b" not in bm.sequence_ids()


def test_bad_arguments_raise_value_error_naming_them_before_any_change():
    bm = BlockManager(4, 8)
    bm.allocate_slots("a", P, 6)
    before = snapshot(bm)
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.allocate_slots("a", P, -1)
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.allocate_slots("new", P, 1.5)
    with pytest.raises(ValueError, match="token_ids"):
        bm.allocate_slots("a", P, 5)
    with pytest.raises(ValueError, match="token_ids"):
        bm.allocate_slots("new", P, 11)
    with pytest.raises(ValueError, match="start/end"):
        bm.slot_mapping("a", 4, 7)
    with pytest.raises(ValueError, match="start/end"):
        bm.slot_mapping("a", 3, 2)
    assert snapshot(bm) == before


@pytest.mark.parametrize("kwargs, name", [
    ({"block_size": 0, "num_blocks": 4}, "block_size"),
    ({"block_size": 4, "num_blocks": 0}, "num_blocks"),
    ({"block_size": 4, "num_blocks": 4, "watermark": 1.0}, "watermark"),
    ({"block_size": 4, "num_blocks": 4, "watermark": -0.1}, "watermark"),
    ({"block_size": 4, "num_blocks": 4, "enable_prefix_caching": 1}, "enable_prefix_caching"),
])
def test_constructor_validates(kwargs, name):
    with pytest.raises(ValueError, match=name):
        BlockManager(**kwargs)


def test_unknown_sequence_and_double_free():
    bm = BlockManager(4, 8)
    for call in (lambda: bm.free("x"), lambda: bm.num_slots("x"), lambda: bm.block_table("x"),
                 lambda: bm.slot_mapping("x", 0, 0)):
        with pytest.raises(UnknownSequenceError, match="'x' is not registered"):
            call()
    bm.allocate_slots("a", P, 10)
    bm.free("a")
    with pytest.raises(DoubleFreeError, match="'a' was already freed") as info:
        bm.free("a")
    assert isinstance(info.value, UnknownSequenceError) and isinstance(info.value, BlockManagerError)
    assert isinstance(info.value, KeyError)
    with pytest.raises(UnknownSequenceError, match="'a' was already freed") as info:
        bm.slot_mapping("a", 0, 1)
    assert not isinstance(info.value, DoubleFreeError)
    assert bm.num_free_blocks == 8
    # re-admission after a preemption reuses the id
    assert bm.allocate_slots("a", P, 2).num_cached_tokens == 8
    bm.free("a")
    bm.check_invariants()


def test_watermark_applies_to_admission_only():
    bm = BlockManager(4, 10, watermark=0.2)  # keeps 2 blocks free at admission
    assert bm.watermark_blocks == 2
    tokens = list(range(40))
    assert bm.can_allocate("a", tokens, 32)  # 8 blocks: leaves 2
    assert not bm.can_allocate("a", tokens, 33)  # 9 blocks: would leave 1
    bm.allocate_slots("a", tokens, 32)
    assert bm.can_allocate("a", tokens, 8)  # a running sequence may use the reserve
    assert not bm.can_allocate("b", [1], 1)
    assert bm.allocate_slots("a", tokens, 8).new_block_ids == [8, 9]


def test_watermark_counts_revived_cached_blocks():
    bm = BlockManager(4, 4, watermark=0.25)  # reserve 1 block
    prompt = P[:9] + [1, 2, 3, 4]  # 13 tokens
    bm.allocate_slots("a", prompt[:9], 9)
    bm.free("a")  # blocks 0 and 1 cached and free
    assert bm.can_allocate("b", prompt[:9], 1)  # 2 revived + 1 new = 3 of 4: leaves 1
    assert not bm.can_allocate("b", prompt, 5)  # 2 revived + 2 new = 4: leaves 0
    assert bm.allocate_slots("b", prompt, 5).new_block_ids == [0, 1, 3, 2]


def test_freeing_everything_returns_all_blocks_and_keeps_keys_findable():
    bm = BlockManager(4, 16)
    bm.allocate_slots("a", P, 10)
    bm.fork("a", "b")
    assert bm.allocate_slots("c", P[:4] + [7] * 9, 9).num_cached_tokens == 4
    keys = bm.pool.cached_keys()
    assert len(keys) == 4  # a: 2 full blocks; c: 3 full blocks, the first one a's
    for seq_id in ("a", "b", "c"):
        bm.free(seq_id)
    assert bm.num_free_blocks == 16 and bm.usage == 0.0
    assert all(bm.ref_count(b) == 0 for b in range(16))
    assert bm.pool.cached_keys() == keys
    assert bm.num_cached_prefix_tokens(P) == 8
    assert bm.num_cached_prefix_tokens(P[:4] + [7] * 9) == 12
    bm.check_invariants()


def test_a_pending_slot_is_reserved_now_and_its_block_hashed_once_its_token_is_known():
    """Async scheduling reserves the slot of a token not sampled yet (``pending_tokens``): the block
    it fills waits for a later call that knows the token, then joins the prefix cache."""
    manager = BlockManager(4, 8)
    tokens = [1, 2, 3]
    manager.allocate_slots("s", tokens, 3)
    assert manager.can_allocate("s", tokens, 1, pending_tokens=1)
    with pytest.raises(ValueError, match="token_ids"):
        manager.allocate_slots("s", tokens, 1)               # the 4th token is unknown without pending
    manager.allocate_slots("s", tokens, 1, pending_tokens=1)   # slot 3 reserved, block 0 full but unknown
    manager.check_invariants()
    assert manager.num_slots("s") == 4 and manager.num_cached_prefix_tokens([1, 2, 3, 9, 5]) == 0
    manager.allocate_slots("s", tokens + [9], 1, pending_tokens=1)   # 9 is known now, the 5th is pending
    manager.check_invariants()
    assert manager.num_cached_prefix_tokens([1, 2, 3, 9, 5]) == 4      # block 0 = [1, 2, 3, 9] cached
    assert manager.num_cached_prefix_tokens([1, 2, 3, 7, 5]) == 0
    with pytest.raises(ValueError, match="pending_tokens"):
        manager.allocate_slots("new", [1, 2], 3, pending_tokens=1)     # a new sequence knows its tokens
    with pytest.raises(ValueError, match="pending_tokens"):
        manager.can_allocate("s", tokens, 1, pending_tokens=-1)
    manager.free("s")
    assert manager.num_free_blocks == 8


def test_truncate_gives_back_draft_slots_and_their_blocks():
    """Speculative decoding's rollback: 6 drafts reserved as pending after 10 known tokens, 2 accepted."""
    bm = BlockManager(4, 16, enable_prefix_caching=True)
    tokens = list(range(10))
    bm.allocate_slots("s", tokens, 10)
    bm.allocate_slots("s", tokens, 6, pending_tokens=6)                 # slots 10..15: drafts
    assert bm.num_slots("s") == 16 and len(bm.block_table("s")) == 4
    free_before = bm.num_free_blocks
    assert bm.truncate("s", 12) == []
    assert bm.num_slots("s") == 12 and len(bm.block_table("s")) == 3 and bm.num_free_blocks == free_before + 1
    bm.allocate_slots("s", tokens + [50, 51], 0)                         # accepted drafts are known now: hashed
    assert bm.num_cached_prefix_tokens(tokens + [50, 51, 7]) == 12
    bm.check_invariants()


@pytest.mark.parametrize("num_slots, message", [(17, "is more than"), (3, "would cut into the 2 hashed"),
                                                (-1, "must be an integer")])
def test_truncate_refuses_what_it_cannot_do_and_changes_nothing(num_slots, message):
    bm = BlockManager(4, 16, enable_prefix_caching=True)
    bm.allocate_slots("s", list(range(10)), 10)
    bm.allocate_slots("s", list(range(10)), 6, pending_tokens=6)
    table = bm.block_table("s")
    with pytest.raises(ValueError, match=f"num_slots: .*{message}"):
        bm.truncate("s", num_slots)
    assert bm.block_table("s") == table and bm.num_slots("s") == 16
    with pytest.raises(UnknownSequenceError):
        bm.truncate("nobody", 0)


def test_add_slot_takes_a_slot_inside_the_last_block_and_hashes_a_block_it_fills():
    twin, bm = BlockManager(4, 16), BlockManager(4, 16)
    tokens = list(P)
    for manager in (bm, twin):
        manager.allocate_slots("a", tokens, 10)                   # blocks 0 1 2, slots 8 9 used in the last
    for _ in range(2):
        tokens.append(len(tokens))
        assert bm.add_slot("a", tokens)
        twin.allocate_slots("a", tokens, 1)
    assert snapshot(bm) == snapshot(twin) and bm.num_slots("a") == 12
    assert bm.num_cached_prefix_tokens(tokens + [99]) == 12          # the filled third block was hashed
    tokens.append(len(tokens))
    assert not bm.add_slot("a", tokens)                            # slot 12 opens a block: nothing changed
    assert snapshot(bm) == snapshot(twin) and bm.num_slots("a") == 12
    other = list(range(500, 510))
    bm.allocate_slots("b", other, 9)
    with pytest.raises(ValueError, match="token_ids"):
        bm.add_slot("b", other[:9])                                # slot 10 needs a 10th token
    assert bm.num_slots("b") == 9
    with pytest.raises(UnknownSequenceError):
        bm.add_slot("nobody", P)


def test_truncate_copies_a_partial_last_block_that_a_fork_cached():
    """A fork taken while a sequence had draft slots pending shares the drafted block; when the fork hashes
    that block (its tokens are its own) and goes, rolling the drafts back must not leave the sequence writing
    into a cached block (found by the state machine test): the block is copied, and the cache keeps it."""
    bm = BlockManager(4, 8)
    bm.allocate_slots("a", [5], 1)
    bm.allocate_slots("a", [5], 3, pending_tokens=3)                  # three drafts: block 0 full, unhashed
    assert bm.fork("a", "b") == []                                    # a full block is shared, not copied
    bm.allocate_slots("b", [5, 6, 6, 6, 7], 1, pending_tokens=1)      # b's tokens include a's drafts: hashed
    bm.free("b")
    assert bm.pool.key_of(0) is not None and bm.ref_count(0) == 1
    copies = bm.truncate("a", 1)                                      # every draft rejected
    assert copies == [(0, 2)] and bm.block_table("a") == [2]
    bm.check_invariants()
    assert bm.num_cached_prefix_tokens([5, 6, 6, 6, 9]) == 4          # the cached block kept its content
