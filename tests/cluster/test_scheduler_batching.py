"""Scheduler decisions with exact expectations: budget split, chunk sizes, decode-first, priority order,
prefix-cache hits, admission errors, stop rules. Real BlockManager (block_size 4), no model."""

import pytest
from helpers.scheduler_harness import EOS, admit, decisions, make_scheduler, params, prompt, step
from pagedray.cluster.outputs import QueueFullError
from pagedray.cluster.plan_builder import PlanBuilder
from pagedray.cluster.request import FinishReason


def test_budget_is_split_decodes_then_partial_prefills_then_waiting():
    sched = make_scheduler(budget=10)
    for rid, length in (("a", 7), ("b", 6), ("c", 3)):
        admit(sched, rid, prompt(length), params())
    # step 0: a takes 7, b gets the remaining 3 (a chunk), c does not fit in the budget
    assert decisions(step(sched)) == [("a", 0, 7), ("b", 0, 3)]
    assert [s.request.request_id for s in sched.waiting] == ["c"]
    # step 1: a decodes (1), b finishes its prompt (3), c is admitted whole (3); 3 tokens unused
    out = step(sched)
    assert decisions(out) == [("a", 0, 1), ("b", 0, 3), ("c", 0, 3)]
    assert out.num_batched_tokens == 7
    # step 2: everyone decodes
    assert decisions(step(sched)) == [("a", 0, 1), ("b", 0, 1), ("c", 0, 1)]


def test_long_prompt_is_chunked_to_the_budget():
    sched = make_scheduler(budget=8)
    admit(sched, "a", prompt(21), params())
    chunks = [decisions(step(sched)) for _ in range(4)]
    assert chunks == [[("a", 0, 8)], [("a", 0, 8)], [("a", 0, 5)], [("a", 0, 1)]]
    seq = sched.requests["a"].sequences[0]
    assert len(seq.output_token_ids) == 2 and seq.num_computed_tokens == 22


def test_running_decode_goes_before_a_higher_priority_partial_prefill():
    sched = make_scheduler(budget=10, policy="priority")
    admit(sched, "x", prompt(2), params(), priority=5)
    assert decisions(step(sched)) == [("x", 0, 2)]
    admit(sched, "y", prompt(30), params(), priority=0)
    assert decisions(step(sched)) == [("x", 0, 1), ("y", 0, 9)]
    # y (more important, mid-prefill) sorts first in the running queue, but x's decode is served first
    assert decisions(step(sched)) == [("x", 0, 1), ("y", 0, 9)]


@pytest.mark.parametrize("policy,expected", [("fcfs", ["x", "y", "z"]), ("priority", ["y", "z", "x"])])
def test_admission_order_follows_the_policy(policy, expected):
    sched = make_scheduler(max_num_seqs=1, policy=policy)
    for rid, prio in (("x", 2), ("y", 0), ("z", 1)):
        admit(sched, rid, prompt(3), params(max_tokens=1), priority=prio)
    order = [decisions(step(sched)) for _ in range(3)]
    assert order == [[(rid, 0, 3)] for rid in expected]
    assert not sched.has_unfinished()


def test_prefix_hit_skips_cached_full_blocks():
    sched = make_scheduler(prefix_caching=True)
    builder = PlanBuilder(sched.block_manager)
    admit(sched, "a", prompt(10), params())
    step(sched, builder=builder)
    admit(sched, "b", prompt(8) + [99, 98, 97], params())
    out, plan = step(sched, builder=builder)
    # the first 8 tokens (2 full blocks of a) are cached: b computes only its 3 new tokens
    assert decisions(out) == [("a", 0, 1), ("b", 0, 3)]
    bm = sched.block_manager
    table_a, table_b = bm.block_table(0), bm.block_table(1)
    assert table_b[:2] == table_a[:2] and table_b[2] not in table_a
    assert [bm.ref_count(b) for b in table_a[:2]] == [2, 2]
    (new,) = plan.new_seqs
    assert (new.seq_id, new.num_computed_tokens, new.num_scheduled_tokens) == (1, 8, 3)
    assert sched.requests["b"].num_cached_prompt_tokens == 8
    assert bm.stats().prefix_hit_tokens == 8


def test_fully_cached_prompt_still_computes_its_last_block():
    sched = make_scheduler(prefix_caching=True)
    admit(sched, "a", prompt(8), params(max_tokens=1))
    step(sched)
    admit(sched, "b", prompt(8), params(max_tokens=1))
    # 8 tokens = 2 full cached blocks, but at least one token must be computed: hit = 4
    assert decisions(step(sched)) == [("b", 0, 4)]
    assert sched.block_manager.stats().prefix_hit_tokens == 4


def test_prefix_caching_off_never_hits():
    sched = make_scheduler(prefix_caching=False)
    admit(sched, "a", prompt(10), params(max_tokens=1))
    step(sched)
    admit(sched, "b", prompt(10), params(max_tokens=1))
    assert decisions(step(sched)) == [("b", 0, 10)]


def test_prompt_too_long_for_max_model_len_is_rejected_before_any_change():
    sched = make_scheduler(max_model_len=12)
    with pytest.raises(ValueError, match=r"prompt_token_ids: the prompt has 12 tokens.*max_model_len=12"):
        admit(sched, "a", prompt(12), params())
    assert not sched.waiting and not sched.requests
    request = admit(sched, "a", prompt(11), params(max_tokens=50))
    step(sched)
    # 11 prompt + 1 output = max_model_len: finished after one token
    assert request.is_finished and request.sequences[0].finish_reason is FinishReason.LENGTH
    assert request.sequences[0].output_token_ids == [7]
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_bad_requests_raise_value_errors_naming_the_argument():
    sched = make_scheduler(max_num_seqs=2, max_waiting=1)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        admit(sched, "a", [], params())
    with pytest.raises(ValueError, match="n: 3 samples exceed max_num_seqs=2"):
        admit(sched, "a", prompt(3), params(n=3))
    with pytest.raises(ValueError, match="priority"):
        admit(sched, "a", prompt(3), params(), priority="high")
    admit(sched, "a", prompt(3), params())
    with pytest.raises(ValueError, match="request_id: 'a' is already in flight"):
        admit(sched, "a", prompt(3), params())
    with pytest.raises(QueueFullError):
        admit(sched, "b", prompt(3), params())
    assert [s.request.request_id for s in sched.waiting] == ["a"]


def test_stop_rules():
    sched = make_scheduler(max_model_len=64)
    admit(sched, "eos", prompt(3), params(max_tokens=10, ignore_eos=False))
    admit(sched, "ignore", prompt(3), params(max_tokens=4, ignore_eos=True))
    admit(sched, "stop_id", prompt(3), params(max_tokens=10, stop=[EOS + 1]))
    requests = dict(sched.requests)
    tokens = iter([EOS, EOS, EOS + 1])  # first step: eos, ignore, stop_id each sample once
    step(sched, token=lambda seq: next(tokens))
    for _ in range(3):
        step(sched)
    seqs = {rid: r.sequences[0] for rid, r in requests.items()}
    assert (seqs["eos"].output_token_ids, seqs["eos"].finish_reason) == ([EOS], FinishReason.STOP)
    assert (seqs["stop_id"].output_token_ids, seqs["stop_id"].finish_reason) == ([EOS + 1], FinishReason.STOP)
    assert seqs["ignore"].output_token_ids == [EOS, 7, 7, 7]
    assert seqs["ignore"].finish_reason is FinishReason.LENGTH
    assert not sched.has_unfinished()
