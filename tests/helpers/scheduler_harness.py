"""Test helpers: a Scheduler over a real BlockManager, stepped without any model.

``step(sched, token)`` plays the worker's part: every scheduled sequence that samples gets ``token``
(or ``token(seq)`` when a callable is given).
"""

from pagedray.block_manager import BlockManager
from pagedray.cluster.scheduler import Scheduler, check_arguments
from pagedray.workers.contract.config import SchedulerConfig
from pagedray.workers.contract.sampling_params import SamplingParams
from pagedray.workers.contract.wire import SampledToken

EOS = 2
FILLER = 7


def make_scheduler(num_blocks=64, block_size=4, budget=64, max_num_seqs=16, policy="fcfs",
                   prefix_caching=False, max_model_len=256, watermark=0.0, max_waiting=64, max_prefill_tokens=0):
    bm = BlockManager(block_size, num_blocks, enable_prefix_caching=prefix_caching, watermark=watermark)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy,
                             max_queued_requests=max_waiting, max_prefill_tokens=max_prefill_tokens)
    return Scheduler(config, bm, max_model_len=max_model_len, eos_token_ids={EOS})


def params(max_tokens=32, n=1, ignore_eos=True, stop=()):
    return SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=ignore_eos, temperature=0.0,
                          stop_token_ids=tuple(stop))


def prompt(length, start=10):
    return list(range(start, start + length))


def step(sched, token=FILLER, builder=None):
    """One scheduler step; with a PlanBuilder, returns (out, plan) instead of out."""
    out = sched.schedule()
    plan = builder.build(out) if builder is not None else None
    sampled = [SampledToken(s.seq.seq_id, token(s.seq) if callable(token) else token)
               for s in out.scheduled if s.samples]
    sched.update(out, sampled)
    return out if builder is None else (out, plan)


def decisions(out):
    """[(request_id, sample index, num_tokens)] in batch order."""
    return [(s.seq.request.request_id, s.seq.index, s.num_tokens) for s in out.scheduled]


def run_until_idle(sched, max_steps=500):
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return
        step(sched)
    raise AssertionError("scheduler did not become idle")


def assert_pool_empty(sched):
    bm = sched.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))
    assert bm.sequence_ids() == []
    assert not sched.running and not sched.waiting and not sched.requests


def admit(sched: Scheduler, request_id, prompt_token_ids, params, priority=0, resume_tokens=()):
    """A request admitted to a bare Scheduler as ``Engine.add`` admits it: the argument checks, the admission
    checks, the enqueue (scheduler tests run without an engine)."""
    check_arguments(prompt_token_ids, params, priority, resume_tokens, sched.max_model_len, sched.config.max_num_seqs)
    sched.check_admission(request_id)
    return sched.enqueue(request_id, prompt_token_ids, params, priority, resume_tokens)
