"""The worker-side mirror of every running sequence, updated only from StepPlans.

See ``workers/contract/wire.py`` for the protocol. Per sequence id the mirror keeps the prompt and output
token ids, ``num_computed_tokens`` (tokens whose K/V are in this rank's cache), the block table and
the sampling params. The scheduler decides; the mirror only follows:

1. ``released_seq_ids`` are dropped first (ids the mirror does not hold are ignored: a sequence
   may be released before it ever reached the workers).
2. Running deltas append their ``accepted_token_ids`` (drafts accepted last step: their K/V are in the
   cache, so they count as computed) and their ``new_token_id`` (the token sampled last step) and extend
   the block table; new sequences are registered in full. ``draft_token_ids`` are this step's speculative
   tokens: inputs after the sequence's own scheduled tokens, never appended to the mirror
   (``MODEL_DRAFT`` placeholders only where the worker has a draft model, which fills them in).
   ``num_kept_blocks`` cuts the block table before ``new_block_ids`` extend it.
3. The batch order is ``plan.decodes``, ``plan.running``, then ``plan.new_seqs``; a sequence with 0
   scheduled tokens is updated but not part of the forward. Decode rows (``DecodeRows``, one token each)
   come back as ``MirrorStep.decode_states``, without a ``BatchedSequence`` per row.
4. After the forward, ``mark_computed`` advances ``num_computed_tokens`` by the scheduled tokens that
   are not drafts.

Next to each state the mirror keeps its block table as a row of one int32 matrix (``BlockTableRows``):
rows stay in place while a sequence lives, new sequences take a free row once, released ones give it
back, and only the blocks a plan adds are written. A decode step reads its block tables with one gather
instead of flattening every table again.

A plan that contradicts the mirror (unknown running id, a new id that is already mirrored, more
scheduled tokens than known tokens, a block table too short for them, a block id outside the KV
cache) raises ValueError naming the field, before the mirror changes. The step's inputs are then
valid by construction; the runner still checks their attention metadata once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..contract.sampling_params import SamplingParams
from ..contract.wire import MODEL_DRAFT, DecodeRows, StepPlan
from ..sampling.sampler import greedy_from


@dataclass
class SequenceState:
    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    params: SamplingParams
    row: int = -1          # its row of the mirror's BlockTableRows
    lora_slot: int = -1    # its LoRA adapter slot (NewSequence.lora_slot)
    state_slot: int = -1   # its slot of a hybrid model's state pool (NewSequence.state_slot)
    # output length from which its sampling is a plain argmax (sampler.greedy_from; None: never)
    greedy_from: int | None = field(init=False)

    def __post_init__(self) -> None:
        self.greedy_from = greedy_from(self.params)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """token ids of positions [start, end) of prompt + output, without concatenating the lists."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]


@dataclass(slots=True)
class BatchedSequence:
    """A mirrored sequence in this step's input batch, with the tokens the plan schedules for it (the
    engine side's ``cluster.scheduler_output.ScheduledSequence`` is what the scheduler decided). Never
    changed after ``of``; not a frozen dataclass only because one is made per sequence per step, and a
    frozen one took 3x as long to create (0.84 against 0.27 us)."""

    state: SequenceState
    num_scheduled_tokens: int          # drafts included
    # every known token is computed after this step: the sequence samples its next token (and, with
    # drafts, one at each draft's position too)
    samples: bool
    draft_token_ids: tuple[int, ...] = ()

    @classmethod
    def of(cls, state: SequenceState, num_scheduled_tokens: int, drafts: tuple[int, ...] = ()) -> BatchedSequence:
        done = state.num_computed_tokens + num_scheduled_tokens - len(drafts) == state.num_tokens
        return cls(state, num_scheduled_tokens, done, drafts)

    @property
    def num_own_tokens(self) -> int:
        """Scheduled tokens that are the sequence's own (not drafts)."""
        return self.num_scheduled_tokens - len(self.draft_token_ids)


def _check_fits(seq_id: int, computed: int, scheduled: int, num_tokens: int, num_blocks: int,
                block_size: int) -> None:
    if scheduled < 0 or computed < 0:
        raise ValueError(f"num_scheduled_tokens: negative count for seq {seq_id}")
    if computed + scheduled > num_tokens:
        raise ValueError(f"num_scheduled_tokens: seq {seq_id} schedules {scheduled} tokens after {computed} "
                         f"computed, but only {num_tokens} tokens are known")
    if computed + scheduled > num_blocks * block_size:
        raise ValueError(f"block_ids: seq {seq_id} has {num_blocks} blocks of {block_size} slots, too few for "
                         f"{computed + scheduled} tokens")


def _check_drafts(seq_id: int, drafts: list[int], model_drafts: bool) -> None:
    """Drafts are token ids, or ``MODEL_DRAFT`` placeholders (all of them) on a worker with a draft model."""
    placeholders = sum(d == MODEL_DRAFT for d in drafts)
    if placeholders and not model_drafts:
        raise ValueError(f"draft_token_ids: seq {seq_id} asks for drafts of a draft model, which this worker "
                         "does not have (speculative_model)")
    if placeholders not in (0, len(drafts)):
        raise ValueError(f"draft_token_ids: seq {seq_id} mixes MODEL_DRAFT placeholders with token ids")


def _check_block_ids(seq_id: int, block_ids: list[int], num_blocks: int | None) -> None:
    if num_blocks is not None and block_ids and (min(block_ids) < 0 or max(block_ids) >= num_blocks):
        raise ValueError(f"block_ids: seq {seq_id} has a block id outside the KV cache [0, {num_blocks})")


class BlockTableRows:
    """Block tables as rows of one int32 matrix ``tables [rows, width]``; a row's entries past its
    sequence's table are stale (readers take the width they need and the counts from the states). Rows
    and columns double when full; a row is reused after its sequence is released."""

    def __init__(self) -> None:
        self.tables = np.zeros((16, 16), dtype=np.int32)      # [rows, width]
        self._free: list[int] = list(range(15, -1, -1))

    def take(self, block_ids: list[int]) -> int:
        if not self._free:
            rows = self.tables.shape[0]
            self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        row = self._free.pop()
        self.write(row, 0, block_ids)
        return row

    def give_back(self, row: int) -> None:
        self._free.append(row)

    def write(self, row: int, start: int, block_ids: list[int]) -> None:
        """Entries ``[start, start + len(block_ids))`` of ``row``."""
        end = start + len(block_ids)
        if end > self.tables.shape[1]:
            width = max(end, 2 * self.tables.shape[1])
            self.tables = np.pad(self.tables, ((0, 0), (0, width - self.tables.shape[1])))
        if block_ids:
            self.tables[row, start:end] = block_ids


class SequenceMirror:
    def __init__(self, block_size: int, num_blocks: int | None = None, model_drafts: bool = False) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks    # size of the KV cache, for the block-id range check (None: skip)
        self.model_drafts = model_drafts   # MODEL_DRAFT placeholders allowed (the worker has a draft model)
        self._seqs: dict[int, SequenceState] = {}
        self.table_rows = BlockTableRows()
        self._num_not_greedy = 0     # mirrored states that are not always a plain argmax (greedy_from != 0)

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def state(self, seq_id: int) -> SequenceState:
        return self._seqs[seq_id]

    @property
    def all_plain_greedy(self) -> bool:
        """Every mirrored sequence samples by a plain argmax at every token (``SequenceState.greedy_from`` 0)."""
        return self._num_not_greedy == 0

    def _validate(self, plan: StepPlan) -> list[SequenceState]:
        """Raises ValueError for a plan that contradicts the mirror; returns the decode rows' states."""
        # per delta only what it changes is checked: a decode step costs O(batch), never O(mirrored)
        released = set(plan.released_seq_ids)
        decode_states = self._validate_decodes(plan.decodes, released, plan.running) if plan.decodes else []
        for delta in plan.running:
            state = self._seqs.get(delta.seq_id)
            if state is None or delta.seq_id in released:
                raise ValueError(f"running: seq {delta.seq_id} is not mirrored by this worker")
            accepted, drafts = len(delta.accepted_token_ids), len(delta.draft_token_ids)
            if drafts:
                _check_drafts(delta.seq_id, delta.draft_token_ids, self.model_drafts)
            if accepted and state.num_computed_tokens != state.num_tokens:
                raise ValueError(f"accepted_token_ids: seq {delta.seq_id} was not decoding (it has "
                                 f"{state.num_tokens - state.num_computed_tokens} uncomputed tokens)")
            known = state.num_tokens + accepted + (delta.new_token_id is not None)
            if drafts and state.num_computed_tokens + accepted + delta.num_scheduled_tokens - drafts != known:
                raise ValueError(f"draft_token_ids: seq {delta.seq_id} has {drafts} drafts, which must follow its "
                                 f"last known token, but num_scheduled_tokens={delta.num_scheduled_tokens} stops "
                                 "elsewhere")
            num_tokens = known + drafts
            kept = len(state.block_ids) if delta.num_kept_blocks is None else delta.num_kept_blocks
            if not isinstance(kept, int) or not 0 <= kept <= len(state.block_ids):
                raise ValueError(f"num_kept_blocks: seq {delta.seq_id} holds {len(state.block_ids)} blocks, "
                                 f"cannot keep {delta.num_kept_blocks!r}")
            _check_block_ids(delta.seq_id, delta.new_block_ids, self.num_blocks)
            _check_fits(delta.seq_id, state.num_computed_tokens + accepted, delta.num_scheduled_tokens, num_tokens,
                        kept + len(delta.new_block_ids), self.block_size)
        seen = set()
        for new in plan.new_seqs:
            if (new.seq_id in self._seqs and new.seq_id not in released) or new.seq_id in seen:
                raise ValueError(f"new_seqs: seq {new.seq_id} is already mirrored by this worker")
            seen.add(new.seq_id)
            _check_block_ids(new.seq_id, new.block_ids, self.num_blocks)
            known, drafts = len(new.prompt_token_ids) + len(new.output_token_ids), len(new.draft_token_ids)
            _check_drafts(new.seq_id, new.draft_token_ids, self.model_drafts)
            if drafts and new.num_computed_tokens + new.num_scheduled_tokens - drafts != known:
                raise ValueError(f"draft_token_ids: seq {new.seq_id} has {drafts} drafts, which must follow its "
                                 f"last known token, but num_scheduled_tokens={new.num_scheduled_tokens} stops "
                                 "elsewhere")
            _check_fits(new.seq_id, new.num_computed_tokens, new.num_scheduled_tokens, known + drafts,
                        len(new.block_ids), self.block_size)
        return decode_states

    def _validate_decodes(self, decodes: DecodeRows, released: set[int], running: list) -> list[SequenceState]:
        """Each row: a mirrored sequence (not released now, listed once) whose every known token is computed,
        so that the token it appends is the one it computes and samples after; its slot within its table (a
        grown row's new block in the cache's range)."""
        seqs, bs = self._seqs, self.block_size
        listed = set(decodes.seq_ids)
        if len(listed) != len(decodes.seq_ids) or not listed.isdisjoint(delta.seq_id for delta in running):
            raise ValueError("decodes: a sequence is listed twice (in decodes, or in decodes and running)")
        grown = dict(zip(decodes.grown, decodes.new_block_ids))
        if len(grown) != len(decodes.grown) or any(not 0 <= i < len(decodes.seq_ids) for i in grown):
            raise ValueError("decodes: grown must hold distinct indices of seq_ids")
        if self.num_blocks is not None and any(not 0 <= b < self.num_blocks for b in decodes.new_block_ids):
            raise ValueError(f"decodes: a new block id lies outside the KV cache [0, {self.num_blocks})")
        states = []
        for i, seq_id in enumerate(decodes.seq_ids):
            state = seqs.get(seq_id)
            if state is None or seq_id in released:
                raise ValueError(f"decodes: seq {seq_id} is not mirrored by this worker")
            computed = state.num_computed_tokens
            if computed != len(state.prompt_token_ids) + len(state.output_token_ids):
                raise ValueError(f"decodes: seq {seq_id} is not decoding (it has uncomputed tokens)")
            if computed >= (len(state.block_ids) + (i in grown)) * bs:
                raise ValueError(f"block_ids: seq {seq_id} has too few blocks for {computed + 1} tokens")
            states.append(state)
        return states

    def apply(self, plan: StepPlan) -> MirrorStep:
        """Validate, then update the mirror; returns the forward's sequences in batch order."""
        decode_states = self._validate(plan)
        for seq_id in plan.released_seq_ids:
            state = self._seqs.pop(seq_id, None)
            if state is not None:
                self.table_rows.give_back(state.row)
                self._num_not_greedy -= state.greedy_from != 0
        if decode_states:
            self._apply_decodes(plan.decodes, decode_states)
        batch = []
        for delta in plan.running:
            state = self._seqs[delta.seq_id]
            if delta.accepted_token_ids:
                state.output_token_ids.extend(delta.accepted_token_ids)
                state.num_computed_tokens += len(delta.accepted_token_ids)
            if delta.new_token_id is not None:
                state.output_token_ids.append(delta.new_token_id)
            if delta.num_kept_blocks is not None:
                del state.block_ids[delta.num_kept_blocks:]
            if delta.new_block_ids:
                self.table_rows.write(state.row, len(state.block_ids), delta.new_block_ids)
                state.block_ids.extend(delta.new_block_ids)
            if delta.num_scheduled_tokens:
                batch.append(BatchedSequence.of(state, delta.num_scheduled_tokens, tuple(delta.draft_token_ids)))
        for new in plan.new_seqs:
            state = SequenceState(new.seq_id, list(new.prompt_token_ids), list(new.output_token_ids),
                                  new.num_computed_tokens, list(new.block_ids), new.sampling_params,
                                  self.table_rows.take(new.block_ids), new.lora_slot, new.state_slot)
            self._seqs[new.seq_id] = state
            self._num_not_greedy += state.greedy_from != 0
            if new.num_scheduled_tokens:
                batch.append(BatchedSequence.of(state, new.num_scheduled_tokens, tuple(new.draft_token_ids)))
        return MirrorStep(decode_states, batch)

    def _apply_decodes(self, decodes: DecodeRows, states: list[SequenceState]) -> None:
        for state, token in zip(states, decodes.token_ids):
            state.output_token_ids.append(token)
        for i, block in zip(decodes.grown, decodes.new_block_ids):
            state = states[i]
            self.table_rows.write(state.row, len(state.block_ids), [block])
            state.block_ids.append(block)

    @staticmethod
    def mark_computed(step: MirrorStep) -> None:
        for state in step.decode_states:
            state.num_computed_tokens += 1
        for item in step.batch:
            item.state.num_computed_tokens += item.num_own_tokens


@dataclass
class MirrorStep:
    """What ``apply`` hands the runner: the decode rows' states (each computes and samples one token), then
    the other scheduled sequences, in batch order."""

    decode_states: list[SequenceState] = field(default_factory=list)
    batch: list[BatchedSequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.decode_states) + len(self.batch)

    def as_batch(self) -> list[BatchedSequence]:
        """Every row as a BatchedSequence (the general input path)."""
        return [BatchedSequence(state, 1, True) for state in self.decode_states] + self.batch
