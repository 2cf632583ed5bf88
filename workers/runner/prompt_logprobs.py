"""Prompt logprobs: for a sequence whose params ask (``prompt_logprobs = k``), the logprob of every
prompt token given the tokens before it, with its rank and the ``k`` most likely tokens there.

A step that computes positions ``[c, c + s)`` of such a sequence yields the entries of prompt tokens
``c + 1 .. min(c + s, P - 1)`` (P = prompt length): the logits at position p predict token p + 1.
Prompt token 0 has no entry. Positions past the prompt (an output token recomputed after a
preemption) yield nothing here; their logprobs come with the sampled tokens.

Decisions: docs/design/workers.md, ``pagedray.workers.runner.prompt_logprobs``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..contract.wire import PromptLogprobs
from .seq_mirror import BatchedSequence

SLICE_ROWS = 256


@dataclass(frozen=True)
class PromptRows:
    """One sequence's prompt-logprob rows in a step: hidden rows ``[row, row + len(targets))``."""

    seq_id: int
    first_index: int        # prompt index of targets[0] (>= 1)
    row: int                # the first of them in the step's flattened hidden states
    targets: list[int]      # the prompt tokens they predict
    k: int                  # top logprobs wanted per position


def plan_prompt_rows(batch: list[BatchedSequence], first_row: int = 0) -> list[PromptRows]:
    """The prompt-logprob rows of a step's batch (batch order; a sequence's tokens are contiguous), whose
    first token is hidden row ``first_row`` (after the step's decode rows)."""
    plans, row = [], first_row
    for scheduled in batch:
        state = scheduled.state
        k = state.params.prompt_logprobs
        start = state.num_computed_tokens
        end = min(start + scheduled.num_scheduled_tokens, len(state.prompt_token_ids) - 1)
        if k is not None and end > start:
            plans.append(PromptRows(state.seq_id, start + 1, row, state.prompt_token_ids[start + 1:end + 1], k))
        row += scheduled.num_scheduled_tokens
    return plans


def compute_prompt_logprobs(model, hidden: torch.Tensor, plans: list[PromptRows]) -> list[PromptLogprobs]:
    """hidden [tokens, hidden] of the step -> the entries (rank 0; other ranks return [])."""
    results = []
    for plan in plans:
        logprobs_, ranks, tops = [], [], []
        for lo in range(0, len(plan.targets), SLICE_ROWS):
            targets = plan.targets[lo:lo + SLICE_ROWS]
            rows = hidden[plan.row + lo:plan.row + lo + len(targets)]              # [n, hidden]
            logits = model.compute_logits(rows)                                     # [n, vocab] on rank 0
            if logits is None:
                continue
            logprobs = logits.float().log_softmax(dim=1)                           # [n, vocab]
            ids = torch.tensor(targets, device=logprobs.device)[:, None]           # [n, 1]
            chosen = logprobs.gather(1, ids)                                        # [n, 1]
            ranks += (1 + (logprobs > chosen).sum(dim=1)).tolist()
            logprobs_ += chosen[:, 0].tolist()
            if plan.k:
                values, top_ids = logprobs.topk(min(plan.k, logprobs.shape[1]), dim=1)   # [n, k], best first
                tops += [list(zip(i, v)) for i, v in zip(top_ids.tolist(), values.tolist())]
        if logprobs_:
            results.append(PromptLogprobs(plan.seq_id, plan.first_index, logprobs_, ranks,
                                          tops if plan.k else None))
    return results
