"""Grammar-constrained sampling on rank 0: one llguidance matcher per sequence that has a grammar.

``SamplingParams.grammar`` is an llguidance grammar (a JSON string the ingress builds from
``response_format`` / ``structured_outputs``: deploy/structured_output.py). Each step, before the
Sampler, ``GrammarBook.mask`` sets the logits of every token the grammar does not allow next to -inf;
after it, ``GrammarBook.advance`` feeds the sampled tokens to the matchers. When a grammar is complete
it allows only the tokenizer's EOS, which the scheduler's EOS rule turns into finish_reason "stop".

Why llguidance (not xgrammar): no ahead-of-time grammar compilation (its lexer is built lazily while
masks are computed), so nothing slow runs on the step path when a new schema arrives and there is no
compiled-grammar cache to bound; it needs no torch build of its own and installs as one wheel.

Decisions:
- A matcher is keyed by seq_id and remembers how many output tokens it consumed. A row whose output
  length differs (first sight, or a sequence recomputed after preemption that lost its matcher) gets a
  fresh matcher that replays the row's output tokens; released sequences drop theirs.
- Logprobs of grammar rows are those of the masked logits (as in vLLM, where the bitmask is applied
  before the sampler): tokens the grammar forbids have logprob -inf and never appear in top_logprobs.
- Logits wider than the tokenizer's vocabulary (padded embeddings): the extra ids are always masked.
- A matcher in an error state (a token it could not consume: only possible if an engine-side rule
  overrode the mask) raises RuntimeError naming the sequence, which fails the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _Tracked:
    matcher: object        # llguidance.LLMatcher
    consumed: int          # output tokens fed so far


def load_llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError as exc:   # a dependency of the package; a broken install names itself here
        raise RuntimeError("structured output needs the 'llguidance' package (pip install llguidance)") from exc
    return llguidance


class GrammarBook:
    def __init__(self, tokenizer_path: str) -> None:
        self._tokenizer_path = tokenizer_path
        self._lltokenizer = None
        self._tracked: dict[int, _Tracked] = {}

    def __len__(self) -> int:
        return len(self._tracked)

    def _tokenizer(self):
        if self._lltokenizer is None:
            from transformers import AutoTokenizer

            llguidance = load_llguidance()
            self._lltokenizer = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(self._tokenizer_path))
        return self._lltokenizer

    def _matcher(self, seq_id: int, grammar: str, output_token_ids: list[int]):
        tracked = self._tracked.get(seq_id)
        if tracked is None or tracked.consumed != len(output_token_ids):
            llguidance = load_llguidance()
            matcher = llguidance.LLMatcher(self._tokenizer(), grammar)
            if output_token_ids:
                matcher.consume_tokens(list(output_token_ids))
            tracked = self._tracked[seq_id] = _Tracked(matcher, len(output_token_ids))
        if tracked.matcher.is_error():
            raise RuntimeError(f"sequence {seq_id}: grammar matcher error: {tracked.matcher.get_error()}")
        return tracked.matcher

    def mask(self, logits: torch.Tensor, rows) -> torch.Tensor:
        """``logits [rows, vocab]`` with every token the row's grammar forbids at -inf (a copy when any row
        has a grammar; ``rows``: SamplingRow, in logits order)."""
        wanted = [i for i, r in enumerate(rows) if r.params.grammar is not None]
        if not wanted:
            return logits
        llguidance = load_llguidance()
        tokenizer = self._tokenizer()
        bitmask = llguidance.torch.allocate_token_bitmask(len(wanted), tokenizer.vocab_size)   # [n, words] int32
        for j, i in enumerate(wanted):
            row = rows[i]
            llguidance.torch.fill_next_token_bitmask(
                self._matcher(row.seq_id, row.params.grammar, row.output_token_ids), bitmask, j)
        allowed = _unpack(bitmask, logits.shape[1]).to(logits.device)                        # [n, vocab] bool
        out = logits.clone()
        out[wanted] = out[wanted].masked_fill(~allowed, float("-inf"))
        return out

    def advance(self, rows, token_ids: list[int]) -> None:
        """Feed each grammar row's sampled token to its matcher."""
        for row, token_id in zip(rows, token_ids):
            if row.params.grammar is None:
                continue
            tracked = self._tracked[row.seq_id]
            if not tracked.matcher.consume_token(token_id):
                raise RuntimeError(f"sequence {row.seq_id}: token {token_id} is not allowed by its grammar: "
                                   f"{tracked.matcher.get_error()}")
            tracked.consumed += 1

    def release(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self._tracked.pop(seq_id, None)


def _unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """llguidance's ``[n, words]`` int32 bitmask (bit b of word w = token 32 w + b) -> ``[n, vocab]`` bool;
    ids past the bitmask's end are False."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1                                               # [n, words, 32]
    allowed = bits.reshape(bitmask.shape[0], -1).bool()                                      # [n, 32 words]
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    padding = torch.zeros(allowed.shape[0], vocab - allowed.shape[1], dtype=torch.bool)
    return torch.cat([allowed, padding], dim=1)
