"""The llguidance resource limits every grammar runs under: the ingress' check (deploy/structured_output.py)
and the worker's matchers (workers/grammar.py) import this one function, so a grammar the ingress admits
is one the worker can run with the same budget.

Why these numbers (llguidance 1.9, the default SmolLM2 tokenizer of 49,152 tokens, a shared 2-core
machine at load average 2.5; the ingress' check is: build the matcher, compute its first mask, take one
step and compute the second mask; times are the check's median [min-max] of 3, uncached):

- ``initial_lexer_fuel`` 200_000 (llguidance's default: 1_000_000). It bounds the lexer work of a new
  grammar's first mask, and so the time one request may hold the ingress' prepare thread. The red
  team's ``(a{1000}){1000}`` spends 0.5-0.9 s in its first mask at the default and passes it (the
  engine then fails on its first step: "lexer error: too many expressions constructed"); at 200_000 the
  check refuses it in 99 ms [97-113] (30 ms at 100_000). ``a{100000}`` is refused in 40 ms [36-40]
  (accepted at the default: 75 ms, then 19 ms of lexer work per step). Ordinary grammars stay far
  below the budget: an object of 4 patterned / formatted strings 1.1 ms, 200 properties 6 ms, a
  recursive tree schema 0.6 ms, an enum of 1,000 strings 2.5 ms and of 8,000 18 ms, an e-mail regex
  0.9 ms. An enum of 20,000 strings is past it ("initial lexer configuration (grammar) too big"), as it
  is past the ingress' 256 KiB grammar text cap already.
- ``step_lexer_fuel`` 200_000, ``step_max_items`` 50_000, ``max_items_in_row`` 2_000: llguidance's
  defaults (about 15 ms of lexer and 2.5 ms of parser work per mask at its stated speeds). They bound
  every step of the engine's mask, not only the first; nothing ordinary came near them, and lower values
  would end long, legitimate generations midway.
- ``max_lexer_states`` 250_000, ``max_grammar_size`` 500_000: llguidance's defaults (the ingress caps a
  grammar's text at 256 KiB before llguidance sees it: deploy/structured_output.py).
- ``precompute_large_lexemes`` True (the default): without it ``(a{1000}){1000}`` passes its first step
  and then costs 0.4 s on every step of the engine.
- ``verbose_errors`` False: error messages carry no parser state or grammar details (they reach clients).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import llguidance

INITIAL_LEXER_FUEL = 200_000
STEP_LEXER_FUEL = 200_000
STEP_MAX_ITEMS = 50_000
MAX_ITEMS_IN_ROW = 2_000
MAX_LEXER_STATES = 250_000
MAX_GRAMMAR_SIZE = 500_000


def grammar_limits() -> llguidance.LLParserLimits:
    """A fresh ``LLParserLimits`` with the numbers above (llguidance is imported on first use)."""
    from pagedray.workers.grammar import load_llguidance

    return load_llguidance().LLParserLimits(
        max_items_in_row=MAX_ITEMS_IN_ROW, initial_lexer_fuel=INITIAL_LEXER_FUEL, step_lexer_fuel=STEP_LEXER_FUEL,
        step_max_items=STEP_MAX_ITEMS, max_lexer_states=MAX_LEXER_STATES, max_grammar_size=MAX_GRAMMAR_SIZE,
        precompute_large_lexemes=True, verbose_errors=False)
