"""PlanBuilder: turns a SchedulerOutput into the wire StepPlan, sending each sequence in full once.

It remembers, per sequence the workers mirror, how many blocks and tokens they already hold, and
sends a ``NewSequence`` (prompt, output tokens, whole block table) the first time a sequence is
scheduled after admission / re-admission / fork, and a ``RunningDelta`` (only the new block ids and
the one token sampled since) afterwards. Released sequences are dropped from that memory and listed
in ``released_seq_ids`` of the next plan (the workers drop their mirrors before anything else).

A running sequence's step needs its tokens up to ``start + num_tokens`` (its drafts aside); the one
token the mirror lacks is sent by id when the engine knows it, else as ``PENDING_TOKEN`` (async
scheduling: the previous step, still running, samples it; the worker appends its own draw). After a
speculative step the mirror lacks the accepted drafts too: they go first, as ``accepted_token_ids``.
A step's drafts travel as ``draft_token_ids``; the mirror never holds them as tokens. The blocks of
rejected drafts were given back: ``num_kept_blocks`` cuts the workers' block table first (the
scheduler's ``kept_blocks``), and ``new_block_ids`` continue from there.

A sequence whose step is a plain decode (one token, the one the mirror lacks; no drafts, no cut, at most
one new block: the steady state of serving) goes into the plan's ``DecodeRows`` columns instead of a
``RunningDelta`` (wire.py). Speculative configs keep deltas for every sequence, so the batch order of
their rows stays the scheduler's.

Invariant: ``known`` holds exactly the sequence ids the workers mirror after the last built plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedray.workers.contract.wire import PENDING_TOKEN, DecodeRows, NewSequence, RunningDelta, StepPlan

from .scheduler_output import SchedulerOutput


@dataclass
class _Mirror:
    num_blocks: int
    num_tokens: int
    cut: int | None = None     # the workers' table must be cut to this many blocks (speculative rollback)


class PlanBuilder:
    def __init__(self, block_manager, plain_decodes: bool = True) -> None:
        self._block_manager = block_manager
        self._block_size = block_manager.block_size
        self._plain_decodes = plain_decodes      # False: every running sequence as a RunningDelta
        self._known: dict[int, _Mirror] = {}

    @property
    def num_mirrored(self) -> int:
        return len(self._known)

    def build(self, out: SchedulerOutput) -> StepPlan:
        released = [seq_id for seq_id in out.released_seq_ids if self._known.pop(seq_id, None) is not None]
        plan = StepPlan(step_id=out.step_id, released_seq_ids=released, block_copies=list(out.block_copies),
                        state_copies=list(out.state_copies), state_snapshots=list(out.state_snapshots),
                        lora_loads=list(out.lora_loads), lora_reads=list(out.lora_reads),
                        lora_drops=list(out.lora_drops), kv_saves=list(out.kv_saves), kv_loads=list(out.kv_loads))
        for seq_id, kept in out.kept_blocks.items():       # told with the sequence's next delta
            mirror = self._known.get(seq_id)
            if mirror is not None and kept < mirror.num_blocks:
                mirror.num_blocks = kept
                mirror.cut = kept if mirror.cut is None else min(mirror.cut, kept)
        decodes, plain_decodes, block_size = plan.decodes, self._plain_decodes, self._block_size
        for sched in out.scheduled:
            seq = sched.seq
            mirror = self._known.get(seq.seq_id)
            if (mirror is not None and sched.num_tokens == 1 and plain_decodes and mirror.cut is None
                    and sched.start == mirror.num_tokens and not sched.draft_token_ids):
                start, tokens = sched.start, seq.token_ids
                if start < len(tokens) and start // block_size < mirror.num_blocks:   # _add_decode's usual case
                    decodes.seq_ids.append(seq.seq_id)
                    decodes.token_ids.append(tokens[start])
                    mirror.num_tokens = start + 1
                else:
                    self._add_decode(decodes, seq, start, mirror)
                continue
            if mirror is None:
                table = self._block_manager.block_table(seq.seq_id)
                plan.new_seqs.append(NewSequence(
                    seq_id=seq.seq_id,
                    prompt_token_ids=list(seq.prompt_token_ids),
                    output_token_ids=list(seq.output_token_ids),
                    num_computed_tokens=sched.start,
                    num_scheduled_tokens=sched.num_tokens,
                    block_ids=table,
                    sampling_params=seq.params,
                    draft_token_ids=list(sched.draft_token_ids),
                    lora_slot=seq.lora_slot,
                    state_slot=self._block_manager.state_slot(seq.seq_id),
                ))
                self._known[seq.seq_id] = _Mirror(num_blocks=len(table), num_tokens=seq.num_tokens)
                continue
            needed = sched.start + sched.num_tokens - len(sched.draft_token_ids)
            missing = needed - mirror.num_tokens   # <= 0 inside a prefill the workers hold in full
            new_token, accepted = None, []
            if missing >= 1:
                position = mirror.num_tokens
                if needed - 1 > seq.num_tokens:   # only the very last of them may be the pending token
                    raise RuntimeError(f"sequence {seq.seq_id} has {missing} tokens unknown to the workers")
                accepted = list(seq.token_ids[position:needed - 1])
                new_token = seq.token_ids[needed - 1] if needed <= seq.num_tokens else PENDING_TOKEN
            new_blocks = self._block_manager.blocks_from(seq.seq_id, mirror.num_blocks)
            plan.running.append(RunningDelta(
                seq_id=seq.seq_id,
                num_scheduled_tokens=sched.num_tokens,
                new_block_ids=new_blocks,
                new_token_id=new_token,
                accepted_token_ids=accepted,
                draft_token_ids=list(sched.draft_token_ids),
                num_kept_blocks=mirror.cut,
            ))
            mirror.num_blocks += len(new_blocks)      # the workers' table is the whole table again
            mirror.num_tokens = max(mirror.num_tokens, needed)
            mirror.cut = None
        return plan

    def _add_decode(self, decodes: DecodeRows, seq, start: int, mirror: _Mirror) -> None:
        """One plain decode row: the token at ``start`` (sampled last step, or pending) and, when its slot
        opens a block, that block (the table grows only there: a cut goes through a RunningDelta)."""
        tokens = seq.token_ids
        if start > len(tokens):
            raise RuntimeError(f"sequence {seq.seq_id} has {start + 1 - len(tokens)} tokens unknown to the workers")
        decodes.seq_ids.append(seq.seq_id)
        decodes.token_ids.append(tokens[start] if start < len(tokens) else PENDING_TOKEN)
        if start // self._block_size >= mirror.num_blocks:
            new_blocks = self._block_manager.blocks_from(seq.seq_id, mirror.num_blocks)
            if len(new_blocks) != 1:
                raise RuntimeError(f"sequence {seq.seq_id}: a decode at position {start} holds {len(new_blocks)} "
                                   f"blocks the workers lack, not one")
            decodes.grown.append(len(decodes.seq_ids) - 1)
            decodes.new_block_ids.append(new_blocks[0])
            mirror.num_blocks += 1
        mirror.num_tokens = start + 1

    def forget_all(self) -> list[int]:
        """Drop every mirror (after an engine failure); returns the ids the workers may still hold."""
        ids = list(self._known)
        self._known.clear()
        return ids
