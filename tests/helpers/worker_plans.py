"""Test helper: a minimal scheduler that drives workers with hand-built StepPlans.

``PlanDriver`` admits one prompt per step (so prefill chunks and decode tokens share steps), gives
each running sequence at most ``max_chunk`` tokens per step within a per-step ``token_budget``
(chunked prefill), allocates slots with the real ``BlockManager`` (which also produces prefix-cache
hits when enabled), and sends every plan to ``execute`` (a callable: plan -> StepResult). It stops a
sequence after ``max_new_tokens`` sampled tokens and releases it in the next plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedray.block_manager import BlockManager
from pagedray.workers.contract.sampling_params import SamplingParams
from pagedray.workers.contract.wire import NewSequence, RunningDelta, SampledToken, StepPlan, StepResult


@dataclass
class DriverSeq:
    seq_id: int
    prompt: list[int]
    params: SamplingParams
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    sampled: list[SampledToken] = field(default_factory=list)
    num_computed: int = 0
    sent_blocks: int = 0
    pending_token: int | None = None
    admitted: bool = False
    num_cached_at_admission: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_new_tokens


class PlanDriver:
    def __init__(self, execute, block_size: int, num_blocks: int, token_budget: int = 64, max_chunk: int = 64,
                 enable_prefix_caching: bool = False, num_state_slots: int = 16) -> None:
        """``num_state_slots``: each admitted sequence also holds a state slot (what a hybrid model's engine
        hands out; other models ignore it); at most the workers' ``max_num_seqs``."""
        self.execute = execute
        self.block_manager = BlockManager(block_size, num_blocks, enable_prefix_caching=enable_prefix_caching,
                                          num_state_slots=num_state_slots)
        self.token_budget = token_budget
        self.max_chunk = max_chunk
        self.step_id = 0
        self.released: list[int] = []
        self.next_seq_id = 0
        self.plans: list[StepPlan] = []

    def _schedule_running(self, seq: DriverSeq, budget: int) -> RunningDelta:
        if seq.pending_token is not None:
            seq.output.append(seq.pending_token)
        n = min(len(seq.tokens) - seq.num_computed, self.max_chunk, budget)
        self.block_manager.allocate_slots(seq.seq_id, seq.tokens, n)
        table = self.block_manager.block_table(seq.seq_id)
        delta = RunningDelta(seq.seq_id, n, table[seq.sent_blocks:], seq.pending_token)
        seq.sent_blocks, seq.pending_token = len(table), None
        return delta

    def _admit(self, seq: DriverSeq, budget: int) -> NewSequence:
        cached = self.block_manager.num_cached_prefix_tokens(seq.tokens)
        n = min(len(seq.tokens) - cached, self.max_chunk, budget)
        allocation = self.block_manager.allocate_slots(seq.seq_id, seq.tokens, n)
        assert allocation.num_cached_tokens == cached
        table = self.block_manager.block_table(seq.seq_id)
        seq.admitted, seq.num_computed, seq.sent_blocks = True, cached, len(table)
        seq.num_cached_at_admission = cached
        return NewSequence(seq.seq_id, list(seq.prompt), [], cached, n, table, seq.params,
                           state_slot=self.block_manager.state_slot(seq.seq_id))

    def step(self, running: list[DriverSeq], admit: DriverSeq | None) -> StepResult:
        budget = self.token_budget
        plan = StepPlan(self.step_id, released_seq_ids=self.released)
        self.released = []
        scheduled = []
        for seq in running:
            if budget == 0:
                break
            delta = self._schedule_running(seq, budget)
            plan.running.append(delta)
            scheduled.append((seq, delta.num_scheduled_tokens))
            budget -= delta.num_scheduled_tokens
        if admit is not None and budget > 0:
            new = self._admit(admit, budget)
            plan.new_seqs.append(new)
            scheduled.append((admit, new.num_scheduled_tokens))
        result = self.execute(plan)
        self.plans.append(plan)
        self.step_id += 1
        for seq, n in scheduled:
            seq.num_computed += n
        by_id = {seq.seq_id: seq for seq, _ in scheduled}
        expected = [seq.seq_id for seq, _ in scheduled if seq.num_computed == len(seq.tokens)]
        assert [s.seq_id for s in result.sampled] == expected, "sampled rows must follow the batch order"
        for sampled in result.sampled:
            seq = by_id[sampled.seq_id]
            seq.sampled.append(sampled)
            if len(seq.output) + 1 < seq.max_new_tokens:
                seq.pending_token = sampled.token_id       # sent with the next plan's delta
                continue
            seq.output.append(sampled.token_id)
            self.block_manager.free(seq.seq_id)
            self.released.append(seq.seq_id)
        return result

    def add(self, prompt: list[int], max_new_tokens: int, params: SamplingParams | None = None) -> DriverSeq:
        params = params or SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
        seq = DriverSeq(self.next_seq_id, list(prompt), params, max_new_tokens)
        self.next_seq_id += 1
        return seq

    def run(self, seqs: list[DriverSeq]) -> list[DriverSeq]:
        """Admit one sequence per step, run until all finish; returns the same list."""
        waiting = list(seqs)
        while True:
            running = [s for s in seqs if s.admitted and not s.finished]
            if not waiting and not running:
                break
            admit = waiting.pop(0) if waiting else None
            self.step(running, admit)
            if admit is not None and not admit.admitted:
                waiting.insert(0, admit)
        if self.released:  # deliver the last releases
            self.execute(StepPlan(self.step_id, released_seq_ids=self.released))
            self.step_id += 1
            self.released = []
        return seqs

    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 params: SamplingParams | None = None) -> list[list[int]]:
        return [s.output for s in self.run([self.add(p, max_new_tokens, params) for p in prompts])]


def log_bucket_runs(graphs) -> list[tuple[int, int]]:
    """Wrap ``DecodeGraphs.run`` to record (real rows, bucket) of every decode step it runs."""
    log: list[tuple[int, int]] = []
    run = graphs.run

    def logged(host, token_slots=None):
        log.append((host.num_real_rows, host.shape.seqs))
        return run(host, token_slots)

    graphs.run = logged
    return log
