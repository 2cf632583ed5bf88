"""Preemption by recompute, n > 1 forks and abort in every state, with exact block ids and counts.

Setup for preemption: block_size 4, 4 blocks, two 4-token prompts. Each sequence holds 2 blocks after
8 slots; the 9th slot of the first sequence in queue order needs a third block, which only a victim
can free.
"""

import pytest
from helpers.scheduler_harness import (
    admit,
    assert_pool_empty,
    decisions,
    make_scheduler,
    params,
    prompt,
    run_until_idle,
    step,
)
from pagedray.cluster.plan_builder import PlanBuilder
from pagedray.cluster.request import FinishReason, SequenceStatus


def _fill_two(policy="fcfs", prio_a=0, prio_b=0, builder=False):
    sched = make_scheduler(num_blocks=4, policy=policy, max_model_len=16)  # capacity: 16 slots
    plans = PlanBuilder(sched.block_manager) if builder else None
    admit(sched, "a", prompt(4), params(max_tokens=6), priority=prio_a)
    admit(sched, "b", prompt(4, start=50), params(max_tokens=20), priority=prio_b)
    for _ in range(3):
        step(sched, builder=plans)
    admit(sched, "c", prompt(4, start=90), params(max_tokens=1))
    for _ in range(2):  # steps 3, 4: no free block for c
        out = step(sched, builder=plans)
        if plans is not None:
            out, _ = out
        assert [s.seq.request.request_id for s in out.scheduled] == sorted(
            ["a", "b"], key=lambda r: {"a": prio_a, "b": prio_b}[r] if policy == "priority" else r)
    return sched, plans


def test_preemption_victim_is_latest_arrival_requeued_at_front():
    sched, plans = _fill_two(builder=True)
    b = sched.requests["b"].sequences[0]
    assert sched.block_manager.num_free_blocks == 0
    out, plan = step(sched, builder=plans)  # step 5: a needs a 3rd block -> b is preempted
    assert decisions(out) == [("a", 0, 1)]
    assert out.preempted == [b] and out.released_seq_ids == [b.seq_id] == plan.released_seq_ids
    assert sched.num_preemptions == 1 and b.num_preemptions == 1
    assert [s.request.request_id for s in sched.waiting] == ["b", "c"]
    assert (b.status, b.num_computed_tokens, len(b.output_token_ids)) == (SequenceStatus.WAITING, 0, 5)
    assert b.seq_id not in sched.block_manager.sequence_ids()
    # a reached max_tokens=6 at step 5 and left; b comes back first, recomputing prompt + 5 outputs
    out, plan = step(sched, builder=plans)
    assert decisions(out) == [("b", 0, 9), ("c", 0, 4)]
    new_b = plan.new_seqs[0]
    assert (new_b.seq_id, len(new_b.prompt_token_ids), len(new_b.output_token_ids)) == (b.seq_id, 4, 5)
    assert (new_b.num_computed_tokens, new_b.num_scheduled_tokens) == (0, 9)
    run_until_idle(sched)
    assert sched.num_preemptions == 1
    assert_pool_empty(sched)


def test_priority_policy_preempts_the_least_important_even_if_it_arrived_first():
    sched, _ = _fill_two(policy="priority", prio_a=1, prio_b=0)
    a = sched.requests["a"].sequences[0]
    out = step(sched)
    assert decisions(out) == [("b", 0, 1)]
    assert out.preempted == [a] and sched.num_preemptions == 1
    assert sched.waiting[0] is a


def test_sequence_preempts_itself_when_it_is_the_last_in_queue_order():
    # b alone needs a block while a (earlier, already scheduled this step) holds the rest
    sched = make_scheduler(num_blocks=3)
    admit(sched, "a", prompt(8), params(max_tokens=30))
    admit(sched, "b", prompt(3, start=50), params(max_tokens=30))
    assert decisions(step(sched)) == [("a", 0, 8), ("b", 0, 3)]  # a: blocks 0,1; b: block 2
    out = step(sched)  # a's 9th slot needs a block: victim b (unscheduled, latest)
    assert decisions(out) == [("a", 0, 1)] and [s.request.request_id for s in out.preempted] == ["b"]


def test_n_greater_than_one_forks_after_the_shared_prompt_prefix():
    sched = make_scheduler(max_num_seqs=3)
    plans = PlanBuilder(sched.block_manager)
    admit(sched, "r", prompt(6), params(n=3, max_tokens=2))
    admit(sched, "s", prompt(2, start=40), params(max_tokens=1))
    out, plan = step(sched, builder=plans)
    assert decisions(out) == [("r", 0, 5)]  # r reserves 3 seats; s must wait; no sample yet
    bm = sched.block_manager
    assert bm.block_table(0) == [0, 1]
    out, plan = step(sched, token=lambda seq: 20 + seq.index, builder=plans)
    assert decisions(out) == [("r", 0, 1), ("r", 1, 1), ("r", 2, 1)]
    # the partial block 1 is copied for each child; the full block 0 is shared by all three
    assert out.block_copies == plan.block_copies == [(1, 2), (1, 3)]
    assert [bm.block_table(i) for i in (0, 2, 3)] == [[0, 1], [0, 2], [0, 3]]  # seq 1 is s
    assert bm.ref_count(0) == 3
    assert [(d.seq_id, d.new_token_id) for d in plan.running] == [(0, None)]
    assert [(n.seq_id, n.num_computed_tokens, n.num_scheduled_tokens, n.block_ids) for n in plan.new_seqs] == [
        (2, 5, 1, [0, 2]), (3, 5, 1, [0, 3])]
    request = sched.requests["r"]
    assert [s.output_token_ids for s in request.sequences] == [[20], [21], [22]]
    step(sched)
    assert request.is_finished and [len(s.output_token_ids) for s in request.sequences] == [2, 2, 2]
    run_until_idle(sched)
    assert_pool_empty(sched)


def test_n_greater_than_one_with_a_one_token_prompt_forks_at_admission():
    sched = make_scheduler()
    admit(sched, "r", [5], params(n=2, max_tokens=1))
    out = step(sched)
    assert decisions(out) == [("r", 0, 1), ("r", 1, 1)] and out.block_copies == []
    assert sched.requests == {} and sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def _abort_and_drain(sched, rid):
    request = sched.requests[rid]
    assert sched.abort(rid) is request
    assert all(s.finish_reason is FinishReason.ABORT for s in request.sequences)
    assert sched.abort(rid) is None
    run_until_idle(sched)
    assert_pool_empty(sched)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_abort_waiting_mid_prefill_and_decoding(prefix_caching):
    sched = make_scheduler(budget=6, prefix_caching=prefix_caching)
    admit(sched, "decoding", prompt(3), params(max_tokens=50))
    admit(sched, "prefill", prompt(20, start=30), params(max_tokens=50))
    admit(sched, "waiting", prompt(5, start=60), params(max_tokens=50))
    step(sched)
    step(sched)
    states = {rid: (r.sequences[0].status, r.sequences[0].num_computed_tokens)
              for rid, r in sched.requests.items()}
    assert states == {"decoding": (SequenceStatus.RUNNING, 4), "prefill": (SequenceStatus.RUNNING, 8),
                      "waiting": (SequenceStatus.WAITING, 0)}
    held = sched.block_manager.num_blocks - sched.block_manager.num_free_blocks
    sched.abort("prefill")  # frees its 2 blocks at once
    assert sched.block_manager.num_blocks - sched.block_manager.num_free_blocks == held - 2
    sched.abort("waiting")
    _abort_and_drain(sched, "decoding")


def test_abort_preempted_and_forked_requests():
    sched, _ = _fill_two()
    step(sched)  # b preempted
    assert sched.requests["b"].sequences[0].num_preemptions == 1
    _abort_and_drain(sched, "b")
    sched = make_scheduler()
    admit(sched, "r", prompt(6), params(n=3, max_tokens=10))
    step(sched)
    step(sched)
    assert len(sched.running) == 3
    _abort_and_drain(sched, "r")


def test_queue_time_counts_each_request_once_despite_preemption_and_forks():
    sched, _ = _fill_two(builder=True)
    admit(sched, "forked", prompt(5, start=80), params(max_tokens=2, n=3))
    run_until_idle(sched)
    assert sched.num_preemptions >= 1                       # b was preempted and admitted again
    histogram = sched.queue_time
    assert histogram.count == 4                             # a, b, c, forked: first admissions only
    cumulative = [count for _, count in histogram.cumulative()]
    assert cumulative == sorted(cumulative) and cumulative[-1] <= histogram.count
    assert histogram.sum_s >= 0.0
