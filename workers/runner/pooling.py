"""Pooling: the result of a pooling request (``params.pooling``, an embedding or a score) from the step's hidden
states, the model's final hidden states after its last norm (what transformers calls ``last_hidden_state``).

A step that computes prompt positions ``[c, c + s)`` of such a sequence yields one ``PooledPart``:
- "mean": the sum (float64) of those ``s`` rows; the engine adds the parts of every chunk and divides by the
  prompt length (``cluster/request.py``). A part starting at 0 begins the sum again (a recomputation after a
  preemption starts there);
- "last": only the step that computes the last prompt position yields a part: that row.
With ``pooling_token_ids``, the last prompt position's part also carries those tokens' logits (the LM head,
gathered on rank 0 like every logits row). Positions past the prompt yield nothing.

The LM head is a collective (its gather): every rank runs it for the same rows; rank 0 keeps the parts.

Decisions: docs/design/workers.md, ``pagedray.workers.runner.pooling``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..contract.wire import PooledPart
from .seq_mirror import BatchedSequence


@dataclass(frozen=True)
class PoolRows:
    """One pooling sequence's prompt rows in a step: hidden rows ``[row, row + count)`` = prompt positions
    ``[start, start + count)``."""

    seq_id: int
    kind: str                      # "last" / "mean"
    start: int
    row: int
    count: int
    has_last: bool                 # the prompt's last position is the last of them
    token_ids: tuple[int, ...]     # logits wanted at the last position


def plan_pool_rows(batch: list[BatchedSequence], first_row: int = 0) -> list[PoolRows]:
    """The pooling rows of a step's batch (batch order; a sequence's tokens are contiguous), whose first token is
    hidden row ``first_row`` (after the step's decode rows)."""
    plans, row = [], first_row
    for scheduled in batch:
        state = scheduled.state
        kind, prompt_len = state.params.pooling, len(state.prompt_token_ids)
        start = state.num_computed_tokens
        end = min(start + scheduled.num_scheduled_tokens, prompt_len)
        if kind is not None and end > start and (kind == "mean" or end == prompt_len):
            plans.append(PoolRows(state.seq_id, kind, start, row, end - start, end == prompt_len,
                                  state.params.pooling_token_ids))
        row += scheduled.num_scheduled_tokens
    return plans


def compute_pooled(model, hidden: torch.Tensor, plans: list[PoolRows]) -> list[PooledPart]:
    """hidden [tokens, hidden] of the step -> the parts (rank 0; the other ranks take part in the LM head's
    gather and return [])."""
    first = model.lm_head.tp.is_first
    parts = []
    for plan in plans:
        rows = hidden[plan.row:plan.row + plan.count]                              # [count, hidden]
        logits = []
        if plan.has_last and plan.token_ids:
            full = model.compute_logits(rows[-1:])                                  # [1, vocab] on rank 0
            if full is not None:
                logits = full[0, list(plan.token_ids)].tolist()
        if not first:
            continue
        values = rows.double().sum(dim=0) if plan.kind == "mean" else rows[-1].double()   # [hidden]
        parts.append(PooledPart(plan.seq_id, plan.start, plan.count, values.tolist(), logits))
    return parts
