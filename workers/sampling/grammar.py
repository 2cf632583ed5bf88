"""Grammar-constrained sampling on rank 0: one llguidance matcher per sequence that has a grammar.

``SamplingParams.grammar`` is an llguidance grammar (a JSON string the ingress builds from
``response_format`` / ``structured_outputs``: deploy/openai/structured_output.py, which also compiled it and
computed its first mask under the same limits before admitting the request). Each step:

1. ``submit(rows)`` starts the step's masks on the book's own thread (``compute``), right after the
   plan is applied and before the forward: llguidance drops the GIL while it builds a matcher or a
   mask, so the masks are computed while the forward runs (vLLM and SGLang overlap them the same way);
2. ``apply(logits, masks)`` sets every token a row's grammar does not allow next to -inf;
3. after the Sampler, ``advance(rows, token_ids)`` feeds the sampled tokens to the matchers (with
   speculative drafts: the tokens the sequence keeps; a row's mask is computed after its drafts, which
   are fed and rolled back, ``SamplingRow.num_drafts``).

When a grammar is complete it allows only the tokenizer's EOS, which the scheduler's EOS rule turns
into finish_reason "stop".

Why llguidance (not xgrammar): no ahead-of-time grammar compilation (its lexer is built lazily while
masks are computed), it needs no torch build of its own and installs as one wheel; its
``LLParserLimits`` bound the work of one mask (``grammar_limits.py``).

Decisions: docs/design/workers.md, ``pagedray.workers.sampling.grammar``.
"""

from __future__ import annotations

import collections
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .grammar_limits import grammar_limits, load_llguidance, short_error

TEMPLATES = 16            # compiled matchers kept, one per grammar text (each may hold a large lexer)


@dataclass
class _Tracked:
    matcher: object        # llguidance.LLMatcher
    consumed: int          # output tokens fed so far


@dataclass
class GrammarMasks:
    """The masks of one step: ``bitmask [len(rows), words]`` int32 for the logits rows ``rows`` (the rows
    that have a grammar, in logits order) and the rows whose grammar failed (their masks allow nothing)."""

    rows: list[int]
    bitmask: torch.Tensor
    failures: dict[int, str] = field(default_factory=dict)


class GrammarBook:
    def __init__(self, tokenizer_path: str) -> None:
        self._tokenizer_path = tokenizer_path
        self._lltokenizer = None
        self._tracked: dict[int, _Tracked] = {}
        self._templates: collections.OrderedDict[str, object] = collections.OrderedDict()
        self._pool: ThreadPoolExecutor | None = None   # the mask thread, started on the first grammar row

    def __len__(self) -> int:
        return len(self._tracked)

    def _tokenizer(self):
        if self._lltokenizer is None:
            from transformers import AutoTokenizer

            llguidance = load_llguidance()
            self._lltokenizer = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(self._tokenizer_path))
        return self._lltokenizer

    def _template(self, grammar: str):
        """The compiled matcher of ``grammar`` (never fed a token); LRU over ``TEMPLATES`` texts."""
        template = self._templates.get(grammar)
        if template is None:
            llguidance = load_llguidance()
            template = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0, limits=grammar_limits())
            self._templates[grammar] = template
            if len(self._templates) > TEMPLATES:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(grammar)
        return template

    def _matcher(self, seq_id: int, grammar: str, output_token_ids: list[int]):
        """The row's matcher, up to date with its output tokens; one in an error state is returned as is."""
        tracked = self._tracked.get(seq_id)
        if tracked is None or tracked.consumed != len(output_token_ids):
            template = self._template(grammar)
            matcher = template if template.is_error() else template.deep_copy()
            if output_token_ids and not matcher.is_error():
                matcher.consume_tokens(list(output_token_ids))
            tracked = self._tracked[seq_id] = _Tracked(matcher, len(output_token_ids))
        return tracked.matcher

    # -- masks ----------------------------------------------------------------------------------
    def submit(self, rows) -> Future | None:
        """Starts ``compute(rows)`` on the mask thread; None when no row has a grammar."""
        if not any(r.params.grammar is not None for r in rows):
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedray-grammar")
        return self._pool.submit(self.compute, list(rows))

    def compute(self, rows) -> GrammarMasks | None:
        """The masks of the rows that have a grammar (``rows``: SamplingRow, in logits order); None when
        none has. Never raises for a grammar: a row that fails is in ``failures``."""
        wanted = [i for i, r in enumerate(rows) if r.params.grammar is not None]
        if not wanted:
            return None
        llguidance = load_llguidance()
        tokenizer = self._tokenizer()
        bitmask = llguidance.torch.allocate_token_bitmask(len(wanted), tokenizer.vocab_size)   # [n, words] int32
        failures = {}
        for j, i in enumerate(wanted):
            row = rows[i]
            try:
                committed = len(row.output_token_ids) - row.num_drafts
                matcher = self._matcher(row.seq_id, row.params.grammar, row.output_token_ids[:committed])
                if not matcher.is_error():
                    # a row after speculative drafts: the mask after the ones the grammar allows (a forbidden
                    # draft is masked at its own row, so the rows after it are discarded anyway)
                    fed = matcher.try_consume_tokens(row.output_token_ids[committed:]) if row.num_drafts else 0
                    llguidance.torch.fill_next_token_bitmask(matcher, bitmask, j)
                    if fed:
                        matcher.rollback(fed)
                error = matcher.get_error() if matcher.is_error() else ""
            except Exception as exc:  # noqa: BLE001 - an API-level failure is still this row's alone
                error = f"{type(exc).__name__}: {exc}"
            if error:
                failures[i] = f"its grammar cannot continue: {short_error(error)}"
                bitmask[j] = 0
                self._tracked.pop(row.seq_id, None)
        return GrammarMasks(wanted, bitmask, failures)

    def apply(self, logits: torch.Tensor, masks: GrammarMasks | None) -> torch.Tensor:
        """``logits [rows, vocab]`` with every token a row's grammar forbids at -inf (a copy when any row
        has a grammar)."""
        if masks is None:
            return logits
        allowed = _unpack(masks.bitmask, logits.shape[1]).to(logits.device)                  # [n, vocab] bool
        out = logits.clone()
        out[masks.rows] = out[masks.rows].masked_fill(~allowed, float("-inf"))
        return out

    def mask(self, logits: torch.Tensor, rows) -> torch.Tensor:
        """``apply(logits, compute(rows))`` on the caller's thread."""
        return self.apply(logits, self.compute(rows))

    def advance(self, rows, token_ids: list[int], skip: frozenset[int] = frozenset()) -> dict[int, str]:
        """Feeds each grammar row's sampled token to its matcher (rows in ``skip`` failed already: their
        matchers are dropped); returns ``{row index: message}`` for rows whose matcher refused it."""
        failures = {}
        for i, (row, token_id) in enumerate(zip(rows, token_ids)):
            if row.params.grammar is None:
                continue
            tracked = self._tracked.get(row.seq_id)
            if i in skip or tracked is None:
                self._tracked.pop(row.seq_id, None)
                continue
            if tracked.matcher.consume_token(token_id):
                tracked.consumed += 1
            else:
                failures[i] = f"its grammar refused token {token_id}: {short_error(tracked.matcher.get_error())}"
                self._tracked.pop(row.seq_id, None)
        return failures

    def release(self, seq_ids) -> None:
        for seq_id in seq_ids:
            self._tracked.pop(seq_id, None)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


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
