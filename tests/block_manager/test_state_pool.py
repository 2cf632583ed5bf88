"""The state pool of hybrid models (block_manager/state_pool.py) inside the BlockManager: a slot is taken with a
sequence's registration and its fork, given back by ``free``, never held twice; a manager whose slots are all
held refuses new sequences (``can_allocate`` False, ``allocate_slots`` / ``fork`` raise before changing
anything); random admit / fork / free interleavings keep every invariant."""

from __future__ import annotations

import random

import pytest
from pagedray.block_manager import BlockManager
from pagedray.block_manager.state_pool import StatePool


def _manager(slots: int = 3) -> BlockManager:
    return BlockManager(4, 32, enable_prefix_caching=False, num_state_slots=slots)


def test_slots_follow_registration_fork_and_free():
    bm = _manager()
    bm.allocate_slots("a", [1, 2, 3, 4, 5], 5)
    bm.fork("a", "b")
    assert (bm.state_slot("a"), bm.state_slot("b"), bm.state_slot("c")) == (0, 1, -1)
    bm.free("a")
    assert bm.stats().num_free_state_slots == 2
    bm.allocate_slots("c", [1], 1)
    assert bm.state_slot("c") == 0                       # the lowest free slot again
    bm.check_invariants()


def test_no_free_slot_refuses_new_sequences_and_changes_nothing():
    bm = _manager(slots=2)
    bm.allocate_slots("a", [1, 2], 2)
    bm.allocate_slots("b", [3, 4], 2)
    before = (bm.num_free_blocks, bm.stats().num_free_state_slots, bm.sequence_ids())
    assert not bm.can_allocate("c", [5], 1)
    assert bm.can_allocate("a", [1, 2, 6], 1)            # a registered sequence needs no new slot
    with pytest.raises(RuntimeError, match="state slots"):
        bm.allocate_slots("c", [5], 1)
    with pytest.raises(RuntimeError, match="state slots"):
        bm.fork("a", "c")
    assert (bm.num_free_blocks, bm.stats().num_free_state_slots, bm.sequence_ids()) == before
    bm.check_invariants()


def test_without_a_pool_every_slot_is_minus_one():
    bm = BlockManager(4, 8)
    bm.allocate_slots("a", [1], 1)
    assert bm.state_slot("a") == -1 and bm.states is None and bm.stats().num_state_slots == 0


@pytest.mark.parametrize("seed", range(5))
def test_random_admissions_forks_and_frees_keep_the_invariants(seed):
    rng = random.Random(seed)
    bm, live, next_id = _manager(slots=6), [], 0
    for _ in range(300):
        action = rng.random()
        if action < 0.4 and bm.can_allocate(next_id, [1, 2], 2):
            bm.allocate_slots(next_id, [1, 2], 2)
            live.append(next_id)
            next_id += 1
        elif action < 0.6 and live and bm.stats().num_free_state_slots:
            bm.fork(rng.choice(live), next_id)
            live.append(next_id)
            next_id += 1
        elif live:
            bm.free(live.pop(rng.randrange(len(live))))
        bm.check_invariants()
        slots = [bm.state_slot(s) for s in live]
        assert len(set(slots)) == len(slots) and all(0 <= s < 6 for s in slots)
    for seq in live:
        bm.free(seq)
    assert bm.stats().num_free_state_slots == 6 and bm.num_free_blocks == 32


def test_a_bad_slot_count_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="num_state_slots"):
        StatePool(-1)
