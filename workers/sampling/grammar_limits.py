"""The llguidance resource limits every grammar runs under: the ingress' check (deploy/openai/structured_output.py)
and the worker's matchers (workers/sampling/grammar.py) import this one function, so a grammar the ingress admits
is one the worker can run with the same budget. ``load_llguidance`` (the package, imported on first use)
lives here too, so that grammar.py imports this module and not the other way round.

Decisions: docs/design/workers.md, ``pagedray.workers.sampling.grammar_limits``.
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


def load_llguidance():
    """The llguidance module (with its hf and torch parts), imported on first use; RuntimeError naming the
    package when it is missing."""
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError as exc:   # a dependency of the package; a broken install names itself here
        raise RuntimeError("structured output needs the 'llguidance' package (pip install llguidance)") from exc
    return llguidance


def grammar_limits() -> llguidance.LLParserLimits:
    """A fresh ``LLParserLimits`` with the numbers above (llguidance is imported on first use)."""
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
