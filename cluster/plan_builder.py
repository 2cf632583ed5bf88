"""PlanBuilder: turns a SchedulerOutput into the wire StepPlan, sending each sequence in full once.

It remembers, per sequence the workers mirror, how many blocks and tokens they already hold, and
sends a ``NewSequence`` (prompt, output tokens, whole block table) the first time a sequence is
scheduled after admission / re-admission / fork, and a ``RunningDelta`` (only the new block ids and
the one token sampled since) afterwards. Released sequences are dropped from that memory and listed
in ``released_seq_ids`` of the next plan (the workers drop their mirrors before anything else).

Invariant: ``known`` holds exactly the sequence ids the workers mirror after the last built plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedray.workers.contract.wire import NewSequence, RunningDelta, StepPlan

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
                    num_computed_tokens=seq.num_computed_tokens,
                    num_scheduled_tokens=sched.num_tokens,
                    block_ids=table,
                    sampling_params=seq.params,
                ))
            else:
                unsent = seq.num_tokens - mirror.num_tokens
                if unsent not in (0, 1):
                    raise RuntimeError(f"sequence {seq.seq_id} has {unsent} tokens unknown to the workers")
                plan.running.append(RunningDelta(
                    seq_id=seq.seq_id,
                    num_scheduled_tokens=sched.num_tokens,
                    new_block_ids=table[mirror.num_blocks:],
                    new_token_id=seq.output_token_ids[-1] if unsent else None,
                ))
            self._known[seq.seq_id] = _Mirror(num_blocks=len(table), num_tokens=seq.num_tokens)
        return plan

    def forget_all(self) -> list[int]:
        """Drop every mirror (after an engine failure); returns the ids the workers may still hold."""
        ids = list(self._known)
        self._known.clear()
        return ids
