"""Verification of speculative drafts on rank 0 (the engine side: cluster/speculation.py).

A sequence with k drafts has k + 1 logits rows (input_batch), row j at the position of draft j (the
last row after every draft), and its SamplingRow j sees the drafts before it as output tokens, so
penalties, ``min_tokens``, logprobs and a seed's (seed, position) noise are those of a plain step at
that position. The Sampler samples every row; ``verify`` then keeps, per sequence, the tokens sampled
at rows 0, 1, ... up to and including the first one that differs from its draft (or the last row): the
accepted drafts (each equal to the token sampled at its position) and the step's own next token. A row
that failed (``error``) ends its sequence's tokens there.

A sequence with a grammar speculates too: row j's mask is its grammar's after the drafts before it
(``GrammarBook.compute`` feeds them to the matcher and rolls them back), so a draft the grammar forbids
cannot be sampled and is rejected; the kept tokens then advance the matcher (``Worker.sample``).
"""

from __future__ import annotations

from ..contract.wire import SampledToken


def verify(sampled: list[SampledToken], row_drafts: tuple[tuple[int, ...], ...]) -> list[int]:
    """``sampled`` (one per logits row) -> the indices of the rows whose tokens each sequence keeps, in row
    order. ``row_drafts``: per row, the drafts before its position (empty: no speculation in this step,
    every row kept)."""
    if not row_drafts:
        return list(range(len(sampled)))
    if len(row_drafts) != len(sampled):
        raise ValueError(f"row_drafts: {len(row_drafts)} rows for {len(sampled)} sampled tokens")
    kept: list[int] = []
    start = 0
    while start < len(sampled):
        end = start + 1      # the rows of one sequence are consecutive, with 0, 1, ..., k drafts before them
        while end < len(sampled) and sampled[end].seq_id == sampled[start].seq_id:
            end += 1
        drafts = row_drafts[end - 1]
        for j in range(start, end):
            token = sampled[j]
            kept.append(j)
            position = j - start
            if token.error is not None or position == len(drafts) or token.token_id != drafts[position]:
                break
        start = end
    return kept


def cut_after_errors(tokens: list[SampledToken]) -> list[SampledToken]:
    """``tokens`` without those that follow a failed one (``error``) of the same sequence."""
    failed: set[int] = set()
    out = []
    for token in tokens:
        if token.seq_id in failed:
            continue
        out.append(token)
        if token.error is not None:
            failed.add(token.seq_id)
    return out
