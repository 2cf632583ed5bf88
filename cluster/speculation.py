"""Speculative decoding on the engine side: who proposes draft tokens, and the acceptance counters.

A decode step of a sequence normally computes one token (the last one sampled) and samples the next.
With ``num_speculative_tokens = k`` the scheduler asks a ``Proposer`` for up to k draft tokens that
might follow; the step then computes the last token plus the drafts (k + 1 positions) and rank 0
samples at every one of them. Draft i is accepted when the token sampled at its position equals it,
and the first position that differs gives the step's last token (the target's own); so a step emits
1 to k + 1 tokens. Verification lives in ``workers/sampling/speculative.py``; the scheduler rolls the
rejected drafts' KV slots back (``BlockManager.truncate``).

Why this verification is exact: each sampled position draws from the target's distribution with the
noise a plain step would use at that position (greedy: argmax; seeded: noise by (seed, position)), so
the emitted tokens are the tokens plain decoding emits, given the same noise. For a deterministic
proposal (n-gram) this is also rejection sampling's distribution: a draft d is kept with probability
p(d) and a rejected position yields a draw from p without d, renormalised.

Proposers (``Proposer.propose_batch``: one call per step for every decoding sequence that may speculate):

- ``NgramProposer`` (prompt lookup, as vLLM's ``ngram`` method): the longest suffix of the sequence's
  tokens, ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens long, is looked up among the
  earlier tokens (prompt and output); the latest earlier occurrence wins, and the tokens that followed
  it are the proposal.
- ``RankDraftSlots`` (``speculative_model``): a small model with the target's vocabulary, sharded over the
  same TP ranks with a paged KV cache of its own under the same block ids, drafts greedily in the step
  itself, before the target forward (workers/runner/draft_model.py); the engine reserves k slots per sequence
  (``MODEL_DRAFT`` placeholders) and learns the accepted drafts from the sampled tokens. Its proposals are
  one token with certainty, so verification by equality is rejection sampling there too.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pagedray.workers.contract.wire import MODEL_DRAFT


class Proposer(Protocol):
    def propose_batch(self, requests: list[tuple[Sequence[int], int]]) -> list[list[int]]:
        """Per (token ids, max tokens) request: up to that many draft tokens to follow them (may be none)."""


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's suffix."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"min_n: need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        length = len(token_ids)
        if max_tokens <= 0 or length <= self.min_n:
            return []
        # int32 bytes: bytes.rfind does the search in C; a hit must start on a token boundary
        haystack = array("i", token_ids).tobytes()
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            needle = haystack[4 * (length - n):]
            end = 4 * (length - 1)          # an occurrence must end before the suffix itself does
            while True:
                at = haystack.rfind(needle, 0, end)
                if at < 0:
                    break
                if at % 4 == 0:
                    start = at // 4 + n
                    return list(token_ids[start:start + max_tokens])
                end = at + len(needle) - 1
        return []

    def propose_batch(self, requests: list[tuple[Sequence[int], int]]) -> list[list[int]]:
        return [self.propose(token_ids, max_tokens) for token_ids, max_tokens in requests]


class RankDraftSlots:
    """``speculative_model``: the draft model runs on the TP ranks within the step (workers/runner/draft_model.py);
    the scheduler only reserves the slots, with ``MODEL_DRAFT`` placeholders that the ranks fill in."""

    def propose_batch(self, requests: list[tuple[Sequence[int], int]]) -> list[list[int]]:
        return [[MODEL_DRAFT] * max_tokens for _, max_tokens in requests]


@dataclass
class SpeculationStats:
    """Counters of the proposals (the ``pagedray:spec_decode_*`` metrics)."""

    num_drafts: int = 0                 # steps of a sequence that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    proposed_per_position: list[int] = field(default_factory=list)   # [i]: drafts proposed at position i
    accepted_per_position: list[int] = field(default_factory=list)   # [i]: of them, accepted

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for counts in (self.proposed_per_position, self.accepted_per_position):
            if len(counts) < proposed:
                counts.extend([0] * (proposed - len(counts)))
        for i in range(proposed):
            self.proposed_per_position[i] += 1
            self.accepted_per_position[i] += i < accepted
