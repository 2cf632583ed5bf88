"""Property-based check of the scheduler's invariants under random adds, steps and aborts on a tiny
pool (so preemption, chunking and forks all happen):

- the BlockManager's own invariants hold after every operation;
- every running sequence holds exactly num_computed_tokens slots; waiting/finished ones hold none;
- no step schedules more than the token budget or more than max_num_seqs sequences, nor more prompt tokens
  than ``max_prefill_tokens`` when it is set;
- once everything is aborted or finished, every block is free with ref count 0.
"""

from helpers.scheduler_harness import admit, assert_pool_empty, make_scheduler, params, run_until_idle, step
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedray.cluster.request import SequenceStatus

ADD = st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12), st.integers(1, 3), st.integers(0, 2))
OPS = st.lists(st.one_of(ADD, st.just(("step",)), st.tuples(st.just("abort"), st.integers(0, 40))),
               max_size=60)


def _check(sched, out=None):
    bm = sched.block_manager
    bm.check_invariants()
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING
        assert bm.num_slots(seq.seq_id) == seq.num_computed_tokens
    for seq in sched.waiting:
        assert seq.seq_id not in bm.sequence_ids() and seq.num_computed_tokens == 0
    if out is not None:
        assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
        assert len(out.scheduled) <= sched.config.max_num_seqs


@settings(max_examples=100, deadline=None)
@given(ops=OPS, prefix_caching=st.booleans(), policy=st.sampled_from(["fcfs", "priority"]),
       max_prefill=st.sampled_from([0, 0, 1, 5]))
def test_random_workloads_keep_invariants_and_end_empty(ops, prefix_caching, policy, max_prefill):
    sched = make_scheduler(num_blocks=12, block_size=4, budget=16, max_num_seqs=4, policy=policy,
                           prefix_caching=prefix_caching, max_model_len=40, max_waiting=1000,
                           max_prefill_tokens=max_prefill)
    num_decodes, schedule_decodes = [], sched._schedule_decodes

    def counted(budget, out):            # the scheduler's step 2: how many rows the decodes are
        result = schedule_decodes(budget, out)
        num_decodes.append(len(out.scheduled))
        return result

    sched._schedule_decodes = counted
    added = 0
    for op in ops:
        if op[0] == "add":
            _, length, max_tokens, n, prio = op
            admit(sched, str(added), [3 + (i * 7 + added) % 5 for i in range(length)],
                              params(max_tokens=max_tokens, n=n), priority=prio)
            added += 1
        elif op[0] == "step":
            out = step(sched)
            _check(sched)
            assert out.num_batched_tokens <= 16 and len(out.scheduled) <= 4
            if max_prefill:      # the rows after the decodes: partial prefills and admissions
                prompt = sum(s.num_tokens for s in out.scheduled[num_decodes[-1]:])
                assert prompt <= max_prefill, (prompt, max_prefill)
        else:
            sched.abort(str(op[1]))
        _check(sched)
    run_until_idle(sched, max_steps=2000)
    assert_pool_empty(sched)
