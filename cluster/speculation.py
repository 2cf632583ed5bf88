"""Speculative decoding on the engine side: who proposes draft tokens, and the acceptance counters.

A decode step of a sequence normally computes one token (the last one sampled) and samples the next.
With ``num_speculative_tokens = k`` the scheduler asks a ``Proposer`` for up to k draft tokens that
might follow; the step then computes the last token plus the drafts (k + 1 positions) and rank 0
samples at every one of them. Draft i is accepted when the token sampled at its position equals it,
and the first position that differs gives the step's last token (the target's own); so a step emits
1 to k + 1 tokens. Verification lives in ``workers/speculative.py``; the scheduler rolls the
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
- ``DraftModelProposer`` (``speculative_model``): a small model with the target's vocabulary runs greedily
  in an ``Engine`` of its own, in the engine's process (in-process executor, its own paged KV cache with
  prefix caching, so each step recomputes only the tokens since the sequence's last full block). Its
  proposals are one token with certainty, so verification by equality is rejection sampling there too.
  Not on the TP ranks: on a GPU server the draft model runs where the engine runs (docs/limitations.md).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger(__name__)


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


class DraftModelProposer:
    """Greedy drafts from a small model with the target's vocabulary, in an in-process ``Engine`` of its own."""

    def __init__(self, model: str, dtype: str, device: str, target_vocab_size: int, max_num_seqs: int,
                 block_size: int = 16, num_blocks: int = 2048) -> None:
        from pagedray.workers.contract.config import (
            CacheConfig,
            EngineConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
        )

        from .engine import Engine  # here: engine -> scheduler -> this module

        config = EngineConfig(model=ModelConfig(model=model, dtype=dtype, device=device),
                              cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
                              parallel=ParallelConfig(executor="local"),
                              scheduler=SchedulerConfig(max_num_seqs=max_num_seqs))
        self.engine = Engine(config)
        vocab = self.engine.model_info.vocab_size
        if vocab > target_vocab_size:
            self.engine.shutdown()
            raise ValueError(f"speculative_model: its vocabulary ({vocab} tokens) is larger than the target "
                             f"model's ({target_vocab_size}); the draft model must share the target's tokenizer")
        self._next_id = 0

    def propose_batch(self, requests: list[tuple[Sequence[int], int]]) -> list[list[int]]:
        from pagedray.workers.contract.sampling_params import SamplingParams

        engine, ids = self.engine, {}
        drafts: list[list[int]] = [[] for _ in requests]
        if engine.is_dead:
            return drafts                  # speculation stops; the target engine goes on without it
        try:
            for i, (token_ids, max_tokens) in enumerate(requests):
                if max_tokens <= 0 or len(token_ids) + max_tokens >= engine.max_model_len:
                    continue
                request_id = f"draft-{self._next_id}"
                self._next_id += 1
                engine.add_request(request_id, list(token_ids),
                                   SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
                ids[request_id] = i
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id in ids and out.error is None:
                        drafts[ids[out.request_id]].extend(out.outputs[0].token_ids)
        except Exception:  # noqa: BLE001 - a failing draft model must not take the target engine down
            log.exception("speculative_model failed; no drafts from it from now on")
            engine.fail(RuntimeError("the draft model failed"))
            return [[] for _ in requests]
        return drafts

    def shutdown(self) -> None:
        self.engine.shutdown()


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
