"""The prefix cache of hybrid models (block_manager/state_pool.py, ``BlockManager`` with ``num_state_snapshots``):
a prefix hit stops at the deepest cached block that has a committed state snapshot and names that snapshot as its
seat's source; a registration lists the points where its prefill takes snapshots (where it leaves the cached
blocks, and its last full block's end); a decoding sequence keeps one trailing snapshot at its latest block end and
leaves it cached when it ends; snapshots stay invisible until committed, are evicted least recently used first,
never while pending; random interleavings keep every invariant."""

from __future__ import annotations

import random

import pytest
from pagedray.block_manager import BlockManager
from pagedray.block_manager.state_pool import StatePool

BS = 4


def _manager(seats: int = 4, snapshots: int = 3) -> BlockManager:
    return BlockManager(BS, 64, num_state_slots=seats, num_state_snapshots=snapshots)


def _run_prompt(bm: BlockManager, seq_id, tokens: list[int]) -> tuple:
    """Registers ``tokens`` as one chunk, takes the snapshots its allocation asks for, commits them (the plan ran)
    and frees the sequence; returns the allocation."""
    allocation = bm.allocate_slots(seq_id, tokens, len(tokens) - bm.num_cached_prefix_tokens(tokens))
    for point in allocation.snapshot_points:
        bm.reserve_state_snapshot(seq_id, point)
    bm.commit_state_snapshots()
    bm.free(seq_id)
    return allocation


def test_a_hit_stops_at_the_deepest_block_with_a_snapshot_and_names_it():
    bm = _manager()
    prompt = list(range(10, 23))                          # 13 tokens: 3 full blocks
    first = _run_prompt(bm, "a", prompt)
    assert first.num_cached_tokens == 0 and first.state_source == -1 and first.snapshot_points == (12,)
    # the KV of all three blocks is cached, the state only at token 12: a longer prompt resumes there
    longer = prompt + [1, 2, 3, 4, 5]
    second = bm.allocate_slots("b", longer, len(longer) - 12)
    assert second.num_cached_tokens == 12 and second.state_source == 4      # the first snapshot slot (4 seats)
    assert second.snapshot_points == (16,)                                   # its own last full block
    bm.free("b")
    # a prompt sharing two blocks only: KV cached there, no state at 8 -> no hit, and it snapshots at 8 (the branch)
    branch = prompt[:8] + [90, 91, 92, 93, 94]
    third = bm.allocate_slots("c", branch, len(branch))
    assert third.num_cached_tokens == 0 and third.state_source == -1 and third.snapshot_points == (8, 12)
    assert bm.num_cached_prefix_tokens(branch) == 0
    bm.check_invariants()


def test_a_snapshot_is_invisible_until_committed_and_one_per_key():
    bm = _manager()
    prompt = list(range(30, 39))                          # 9 tokens: a snapshot at 8
    allocation = bm.allocate_slots("a", prompt, 9)
    slot = bm.reserve_state_snapshot("a", 8)
    assert allocation.snapshot_points == (8,) and slot == 4
    assert bm.reserve_state_snapshot("a", 8) is None     # pending already
    assert bm.num_cached_prefix_tokens(prompt + [1]) == 0            # the step writing it has not run
    bm.commit_state_snapshots()
    assert bm.num_cached_prefix_tokens(prompt + [1]) == 8
    assert bm.reserve_state_snapshot("a", 8) is None     # committed already
    bm.check_invariants()


def test_snapshot_points_must_end_a_hashed_block():
    bm = _manager()
    bm.allocate_slots("a", list(range(9)), 9)
    for bad in (0, 6, 12, "8"):
        with pytest.raises(ValueError, match="num_tokens"):
            bm.reserve_state_snapshot("a", bad)
    plain = BlockManager(BS, 8)                              # no state pool
    plain.allocate_slots("x", list(range(5)), 5)
    with pytest.raises(ValueError, match="keeps no states"):
        plain.reserve_state_snapshot("x", 4)


def test_least_recently_used_snapshots_go_first_and_pending_ones_never():
    pool = StatePool(2, 2)
    assert pool.reserve_snapshot("k1") == 2 and pool.reserve_snapshot("k2") == 3
    assert pool.reserve_snapshot("k3") is None           # both slots pending: nothing to evict
    pool.commit_snapshots()
    assert pool.snapshot_of("k1") == 2                   # k1 used: k2 is now the least recently used
    assert pool.reserve_snapshot("k3") == 3 and not pool.has_snapshot("k2")
    pool.check_invariants([])
    pool.commit_snapshots()
    assert pool.reserve_snapshot("k4") == 2 and not pool.has_snapshot("k1")
    pool.check_invariants([])


def test_without_prefix_caching_there_are_no_snapshots():
    bm = BlockManager(BS, 16, enable_prefix_caching=False, num_state_slots=2, num_state_snapshots=4)
    allocation = bm.allocate_slots("a", list(range(9)), 9)
    assert bm.states.num_snapshots == 0 and allocation.snapshot_points == () and allocation.state_source == -1


def test_a_bad_snapshot_count_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="num_state_snapshots"):
        StatePool(2, -1)


@pytest.mark.parametrize("seed", range(4))
def test_random_prompts_keep_the_invariants_and_hits_always_name_a_snapshot(seed):
    """Prompts drawn from a few shared prefixes, admitted, snapshotted, committed at random moments, freed: every
    hit names a committed snapshot slot, and its length is a point some earlier prompt snapshotted."""
    rng = random.Random(seed)
    bm = _manager(seats=5, snapshots=3)
    stems = [[rng.randrange(1, 50) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    live, snapped = [], set()
    for step in range(200):
        if live and (rng.random() < 0.4 or len(live) == 5):
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            prompt = rng.choice(stems) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 9))]
            cached = bm.num_cached_prefix_tokens(prompt)
            allocation = bm.allocate_slots(step, prompt, len(prompt) - cached)
            assert allocation.num_cached_tokens == cached
            if cached:
                assert bm.states.num_slots <= allocation.state_source < bm.states.num_slots + 3
                assert tuple(prompt[:cached]) in snapped
            else:
                assert allocation.state_source == -1
            for point in allocation.snapshot_points:
                if bm.reserve_state_snapshot(step, point) is not None:
                    snapped.add(tuple(prompt[:point]))
            live.append(step)
        if rng.random() < 0.5:
            bm.commit_state_snapshots()
        bm.check_invariants()


def test_a_decoding_sequence_keeps_one_trailing_snapshot_and_leaves_its_last():
    bm = _manager(seats=2, snapshots=3)
    tokens = list(range(40, 47))                          # 7 prompt tokens: no full block
    bm.allocate_slots("a", tokens, 7)
    for token in range(100, 110):                         # decode: one token a step, its id known (sync scheduling)
        tokens.append(token)
        if not bm.add_slot("a", tokens):
            bm.allocate_slots("a", tokens, 1)
        ends_block = len(tokens) % BS == 0
        slot = bm.trail_state_snapshot("a", len(tokens))
        assert (slot is not None) == ends_block
        bm.commit_state_snapshots()
        if ends_block:
            assert bm.states.snapshot_of(bm._block_key(bm._seqs["a"], len(tokens))) == slot
        bm.check_invariants()
    assert len(bm.states._snapshots) == 1                 # at 16 only: the one at 8 was given back
    bm.free("a")
    assert bm.num_cached_prefix_tokens(tokens + [1]) == 16    # the last one stays for the next turn
    pending = BlockManager(BS, 16, num_state_slots=1, num_state_snapshots=2)
    pending.allocate_slots("p", list(range(7)), 7)
    pending.allocate_slots("p", list(range(7)), 1, pending_tokens=1)   # its 8th token not known yet (async)
    assert pending.trail_state_snapshot("p", 8) is None
