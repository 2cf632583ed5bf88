"""What one scheduling decision contains, before it is translated into a wire StepPlan."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedray.workers.contract.wire import LoraFiles, LoraLoad

from .request import Sequence


@dataclass(slots=True)
class ScheduledSequence:
    """``num_tokens`` tokens of ``seq`` are computed this step, from position ``start``.

    ``samples``: after this step every token of the sequence (pending ones included) is computed, so
    the worker samples one. ``epoch``: the sequence's preemption count when scheduled; a result that
    arrives after a later preemption is stale (async scheduling) and is dropped.
    ``draft_token_ids``: speculative tokens (cluster/speculation.py) computed after the sequence's own
    last token; they are the last ``len(draft_token_ids)`` of ``num_tokens``, and the worker samples at
    each of them too."""

    seq: Sequence
    num_tokens: int
    start: int = 0
    samples: bool = False
    epoch: int = 0
    draft_token_ids: tuple[int, ...] = ()


@dataclass
class SchedulerOutput:
    step_id: int
    # batch in scheduling order: running decodes, running partial prefills, then admitted sequences
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    # sequences that left the running set since the previous output (finished, aborted, preempted)
    released_seq_ids: list[int] = field(default_factory=list)
    # copy-on-write block copies (src, dst) from forks made for this step (and speculative rollbacks since
    # the previous one)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # (src, dst) state slots, before the forward: a fork's (parent, child), a hybrid prefix hit's (snapshot, seat)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # (seat, position, snapshot slot): the state a sequence reaches after its first ``position`` tokens, written
    # during this step's forward (a hybrid model's prefix cache: block_manager/state_pool.py)
    state_snapshots: list[tuple[int, int, int]] = field(default_factory=list)
    # speculative rollbacks since the previous output: seq_id -> how many of its blocks (from the start of its
    # table) are unchanged since the workers last saw it; the rest were given back or copied
    kept_blocks: dict[int, int] = field(default_factory=dict)
    # sequences preempted while building this step (already counted and requeued)
    preempted: list[Sequence] = field(default_factory=list)
    # LoRA adapters to load into the ranks' slots before this step (cluster/lora_slots.py)
    lora_loads: list[LoraLoad] = field(default_factory=list)
    # LoRA adapters the ranks start reading into host memory / forget from it (cluster/lora_slots.py)
    lora_reads: list[LoraFiles] = field(default_factory=list)
    lora_drops: list[LoraFiles] = field(default_factory=list)
    # the second KV tier: (block, slot) saves and (slot, block) loads (block_manager/offload_tier.py)
    kv_saves: list[tuple[int, int]] = field(default_factory=list)
    kv_loads: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

