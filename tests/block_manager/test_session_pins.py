"""Session pins: a session's blocks survive pressure that evicts every other free block, expire at their TTL
(the test's own clock), never exceed the budget, and a pinned block handed out anyway is not unpinned twice."""

import random

import pytest
from pagedray.block_manager import BlockKey, BlockManager, BlockPool, SessionPins

BS = 4


def _run(manager: BlockManager, seq_id: str, tokens: list[int]) -> None:
    """A sequence holding every token of ``tokens`` (its cached prefix reused)."""
    manager.allocate_slots(seq_id, tokens, len(tokens) - manager.num_cached_prefix_tokens(tokens))


def test_pinned_blocks_are_evicted_last_and_only_when_nothing_else_is_free():
    manager = BlockManager(BS, 8, pin_budget=4, pin_ttl_s=10.0)
    session_prompt = list(range(100, 113))                # 3 full blocks + 1 token
    _run(manager, "turn1", session_prompt)
    assert manager.pin_session("agent", "turn1", now=0.0) == 3
    pinned = manager.pins.pinned_blocks("agent")
    manager.free("turn1")
    other = list(range(200, 217))                          # 4 full blocks + 1 token: 5 blocks, every unpinned one
    _run(manager, "flood", other)
    assert not set(pinned) & set(manager.block_table("flood"))
    manager.free("flood")
    manager.check_invariants()
    assert manager.num_cached_prefix_tokens(session_prompt + [7]) == 12      # the session's prefix survived
    _run(manager, "huge", list(range(300, 329)))           # needs 8 blocks: the pinned ones go too, last
    assert set(pinned) <= set(manager.block_table("huge"))
    assert manager.stats().num_pin_evictions == 3 and manager.pins.pinned_blocks("agent") == []
    manager.free("huge")
    manager.expire_pins(now=100.0)                          # the evicted blocks are not unpinned a second time
    manager.check_invariants()
    assert all(manager.pool.pin_count(b) == 0 for b in range(8)) and manager.stats().num_pinned_blocks == 0


def test_pins_expire_at_their_ttl_and_a_new_turn_replaces_the_old_pins():
    manager = BlockManager(BS, 16, pin_budget=8, pin_ttl_s=30.0)
    _run(manager, "a1", list(range(100, 109)))
    manager.pin_session("a", "a1", now=0.0)
    first = manager.pins.pinned_blocks("a")
    manager.free("a1")
    _run(manager, "a2", list(range(100, 109)) + list(range(50, 58)))     # the next turn: prefix hit, 4 blocks
    assert manager.block_table("a2")[:2] == first
    manager.pin_session("a", "a2", now=20.0)
    assert manager.pins.pinned_blocks("a") == manager.block_table("a2")[:4] and manager.stats().num_pinned_blocks == 4
    manager.free("a2")
    assert manager.expire_pins(now=49.9) == 0 and manager.stats().num_pinned_sessions == 1
    assert manager.expire_pins(now=50.0) == 1
    assert manager.stats().num_pinned_blocks == 0 and len(manager.pool._free_pinned) == 0
    manager.check_invariants()


def test_the_budget_is_never_exceeded_and_the_oldest_sessions_make_room():
    pool = BlockPool(64)
    pins = SessionPins(pool, budget=6, ttl_s=5.0)
    blocks = pool.allocate(12)
    for i, block_id in enumerate(blocks):
        pool.cache(block_id, BlockKey(None, (i,)))
    assert pins.pin("s1", blocks[0:4], now=0.0) == 4
    assert pins.pin("s2", blocks[4:8], now=1.0) == 4          # s1 (pinned longest ago) makes room
    assert pins.pinned_blocks("s1") == [] and pins.num_pinned == 4
    assert pins.pin("big", blocks[:12], now=2.0) == 6          # alone over the budget: its first 6 blocks
    assert pins.pinned_blocks("big") == blocks[:6] and pins.num_sessions == 1
    assert [pool.pin_count(b) for b in blocks] == [1] * 6 + [0] * 6
    rng = random.Random(0)
    for step in range(300):
        start = rng.randrange(12)
        pins.pin(f"r{rng.randrange(5)}", blocks[start:start + rng.randrange(1, 8)], now=3.0 + step * 0.1)
        assert pins.num_pinned <= 6 and sum(pool.pin_count(b) for b in blocks) <= 6
    for block_id in blocks:
        pool.release(block_id)
    pool.check_invariants()


def test_bad_pin_settings_are_refused():
    with pytest.raises(ValueError, match="budget"):
        SessionPins(BlockPool(4), budget=-1, ttl_s=1.0)
    with pytest.raises(ValueError, match="ttl_s"):
        SessionPins(BlockPool(4), budget=2, ttl_s=0)


def test_the_routing_summary_lists_pinned_blocks_before_other_free_ones():
    """The cache-aware router reads ``cached_prefix_hashes``: a session's pinned blocks make the cut of a short
    summary ahead of blocks freed later, so its next turn is routed to the replica that pins them."""
    manager = BlockManager(BS, 16, pin_budget=8)
    _run(manager, "agent", list(range(100, 109)))
    manager.pin_session("s", "agent", now=0.0)
    pinned = {hash(manager.pool.key_of(b)) for b in manager.pins.pinned_blocks("s")}
    manager.free("agent")
    _run(manager, "later", list(range(200, 217)))
    manager.free("later")                                  # freed after the session's blocks
    assert set(manager.cached_prefix_hashes(2)) == pinned


def test_a_session_with_nothing_cached_holds_no_entry():
    manager = BlockManager(BS, 8, pin_budget=4)
    _run(manager, "short", [1, 2, 3])                     # no full block
    assert manager.pin_session("one-off", "short", now=0.0) == 0 and manager.stats().num_pinned_sessions == 0
