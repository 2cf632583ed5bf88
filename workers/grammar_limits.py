"""The llguidance resource limits every grammar runs under: the ingress' check (deploy/openai/structured_output.py)
and the worker's matchers (workers/grammar.py) import this one function, so a grammar the ingress admits
is one the worker can run with the same budget.

Decisions (the red-team cases of ``benchmarks/red_team_isolation.py`` exercise them against a live server):
- ``initial_lexer_fuel`` 200_000, a fifth of llguidance's default: it bounds the lexer work of a new
  grammar's first masks, and so how long one request may hold an ingress prepare thread. At the default
  the red team's ``(a{1000}){1000}`` passes its first mask and fails only on the engine's first step;
  at this budget the ingress' check refuses it, and ``a{100000}`` with it, while ordinary schemas,
  enums of thousands of strings and common regexes stay far inside it.
- ``step_lexer_fuel``, ``step_max_items``, ``max_items_in_row``: llguidance's defaults. They bound every
  mask the engine computes, not only the first (a matcher past them enters its error state, which ends
  only its own request); lower values would end long, legitimate generations midway.
- ``max_lexer_states``, ``max_grammar_size``: llguidance's defaults (the ingress caps a grammar's text at
  256 KiB before llguidance sees it).
- ``precompute_large_lexemes`` on (the default): without it ``(a{1000}){1000}`` passes its first step and
  then costs its lexer work again on every step of the engine.
- ``verbose_errors`` off: error messages carry no parser state or grammar details (they reach clients).
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
MAX_ERROR_CHARS = 200   # of an llguidance message passed on to a client


def grammar_limits() -> llguidance.LLParserLimits:
    """A fresh ``LLParserLimits`` with the numbers above (llguidance is imported on first use)."""
    from pagedray.workers.grammar import load_llguidance

    return load_llguidance().LLParserLimits(
        max_items_in_row=MAX_ITEMS_IN_ROW, initial_lexer_fuel=INITIAL_LEXER_FUEL, step_lexer_fuel=STEP_LEXER_FUEL,
        step_max_items=STEP_MAX_ITEMS, max_lexer_states=MAX_LEXER_STATES, max_grammar_size=MAX_GRAMMAR_SIZE,
        precompute_large_lexemes=True, verbose_errors=False)


def short_error(message: str) -> str:
    """llguidance's error without parser state: its first line and its ``error:`` reason, capped at
    ``MAX_ERROR_CHARS`` (the ingress' 400s and the engine's per-request errors both say it this way)."""
    lines = [line.strip() for line in message.splitlines() if line.strip() and line.strip() != "<non-verbose/>"]
    if not lines:
        return "llguidance refused it"
    if lines[0] == "NoExtensionBias":   # the parser cannot go on and cannot stop: nothing matches
        return "no text matches it"
    reason = next((line for line in lines[1:] if line.startswith("error:")), "")[:MAX_ERROR_CHARS // 2]
    room = MAX_ERROR_CHARS - len(reason) - 4
    first = lines[0] if len(lines[0]) <= room else lines[0][:room] + "..."
    return f"{first} {reason}".strip()
