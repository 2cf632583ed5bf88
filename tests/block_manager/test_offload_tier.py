"""The second KV tier's bookkeeping: an evicted cached block is saved to a slot, a prompt reaching it again
loads it back (held, uncached, until the load finishes), a failed load leaves nothing cached, the tier is an
LRU, and a slot a plan reads is never the slot a save of the same plan writes."""

from pagedray.block_manager import BlockKey, BlockManager
from pagedray.block_manager.offload_tier import OffloadTier

BS = 4


def _run(manager: BlockManager, seq_id: str, tokens: list[int]) -> None:
    manager.allocate_slots(seq_id, tokens, len(tokens) - manager.num_cached_prefix_tokens(tokens))


def test_an_evicted_block_is_saved_and_a_later_prompt_loads_it_back():
    manager = BlockManager(BS, 6, tier_slots=8)
    prompt = list(range(100, 113))                       # 3 full blocks + 1 token
    _run(manager, "a", prompt)
    table = manager.block_table("a")
    manager.free("a")
    _run(manager, "flood", list(range(200, 221)))        # 6 blocks: every block of "a" is evicted
    saves, loads = manager.take_transfers()
    assert {block for block, _ in saves} == set(table[:3]) and loads == []
    manager.free("flood")
    assert manager.num_cached_prefix_tokens(prompt + [1]) == 0
    hits = manager.tier_prefix(prompt + [1])
    assert [slot for _, slot in hits] == [dict(saves)[block] for block in table[:3]]
    slots = manager.start_loads(hits)
    saves, loads = manager.take_transfers()
    assert [slot for slot, _ in loads] == slots and manager.loads_in_flight(slots)
    assert manager.num_cached_prefix_tokens(prompt + [1]) == 0        # uncached until the load finished
    manager.check_invariants()
    manager.finish_loads(loads, failed=[])
    assert not manager.loads_in_flight(slots) and manager.num_cached_prefix_tokens(prompt + [1]) == 12
    assert manager.stats().num_tier_loaded == 3
    manager.check_invariants()


def test_a_failed_load_is_a_miss_and_frees_its_block():
    manager = BlockManager(BS, 6, tier_slots=8)
    prompt = list(range(100, 109))
    _run(manager, "a", prompt)
    manager.free("a")
    _run(manager, "flood", list(range(200, 221)))
    manager.free("flood")
    manager.take_transfers()
    hits = manager.tier_prefix(prompt)
    slots = manager.start_loads(hits)
    _, loads = manager.take_transfers()
    manager.finish_loads(loads, failed=slots[1:])
    assert manager.num_cached_prefix_tokens(prompt) == 4                # the first block only
    assert manager.num_free_blocks == 6 and manager.stats().num_tier_load_failures == 1
    assert manager.tier_prefix(prompt) == []                            # a loaded or failed key left the tier
    manager.check_invariants()


def test_the_tier_is_an_lru_and_a_slot_being_read_is_not_saved_into():
    tier = OffloadTier(2)
    a, b, c = (BlockKey(None, (i,)) for i in range(3))
    assert tier.save(a) == 0 and tier.save(b) == 1
    assert tier.lookup(a) == 0                       # a is now the most recently used
    assert tier.save(c) == 1 and tier.lookup(b) is None and tier.num_dropped == 1
    assert tier.take(a) == 0                          # read by the plan being built
    assert tier.save(b) == 1                          # the tier is full of c and the held slot: c goes
    assert tier.lookup(c) is None
    tier.release_held()
    assert tier.save(a) == 0
    tier.check_invariants()
