"""PlanBuilder: turns a SchedulerOutput into the wire StepPlan, sending each sequence in full once.

It remembers, per sequence the workers mirror, how many blocks and tokens they already hold, and
sends a ``NewSequence`` (prompt, output tokens, whole block table) the first time a sequence is
scheduled after admission / re-admission / fork, and a ``RunningDelta`` (only the new block ids and
the one token sampled since) afterwards. Released sequences are dropped from that memory and listed
in ``released_seq_ids`` of the next plan (the workers drop their mirrors before anything else).

A running sequence's step needs its tokens up to ``start + num_tokens``; the one token the mirror
lacks is sent by id when the engine knows it, else as ``PENDING_TOKEN`` (async scheduling: the
previous step, still running, samples it; the worker appends its own draw).

Invariant: ``known`` holds exactly the sequence ids the workers mirror after the last built plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedray.workers.contract.wire import PENDING_TOKEN, NewSequence, RunningDelta, StepPlan

from .scheduler_output import SchedulerOutput


@dataclass
class _Mirror:
    num_blocks: int
    num_tokens: int


class PlanBuilder:
    def __init__(self, block_manager) -> None:
        self._block_manager = block_manager
        self._known: dict[int, _Mirror] = {}

    @property
    def num_mirrored(self) -> int:
        return len(self._known)

    def build(self, out: SchedulerOutput) -> StepPlan:
        released = [seq_id for seq_id in out.released_seq_ids if self._known.pop(seq_id, None) is not None]
        plan = StepPlan(step_id=out.step_id, released_seq_ids=released, block_copies=list(out.block_copies))
        for sched in out.scheduled:
            seq = sched.seq
            table = self._block_manager.block_table(seq.seq_id)
            mirror = self._known.get(seq.seq_id)
            if mirror is None:
                plan.new_seqs.append(NewSequence(
                    seq_id=seq.seq_id,
                    prompt_token_ids=list(seq.prompt_token_ids),
                    output_token_ids=list(seq.output_token_ids),
                    num_computed_tokens=sched.start,
                    num_scheduled_tokens=sched.num_tokens,
                    block_ids=table,
                    sampling_params=seq.params,
                ))
                self._known[seq.seq_id] = _Mirror(num_blocks=len(table), num_tokens=seq.num_tokens)
                continue
            needed = sched.start + sched.num_tokens
            missing = needed - mirror.num_tokens   # <= 0 inside a prefill the workers hold in full
            if missing > 1:
                raise RuntimeError(f"sequence {seq.seq_id} has {missing} tokens unknown to the workers")
            new_token = None
            if missing == 1:
                position = mirror.num_tokens
                new_token = seq.token_ids[position] if position < seq.num_tokens else PENDING_TOKEN
            plan.running.append(RunningDelta(
                seq_id=seq.seq_id,
                num_scheduled_tokens=sched.num_tokens,
                new_block_ids=table[mirror.num_blocks:],
                new_token_id=new_token,
            ))
            self._known[seq.seq_id] = _Mirror(num_blocks=len(table), num_tokens=max(mirror.num_tokens, needed))
        return plan

    def forget_all(self) -> list[int]:
        """Drop every mirror (after an engine failure); returns the ids the workers may still hold."""
        ids = list(self._known)
        self._known.clear()
        return ids
