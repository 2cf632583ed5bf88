"""Prompts for the load tester: synthetic ones from a seed, or a JSONL file.

Decisions: docs/design/deploy.md, ``pagedray.deploy.loadtest.prompts``.
"""

from __future__ import annotations

import json
import pathlib
import random
from dataclasses import dataclass

VOCABULARY = (
    "the a river mountain quiet engine paper window garden silver morning evening bright slow quick "
    "market island signal forest letter number station winter summer ocean candle bridge story music "
    "little ancient modern yellow green purple stone cloud thunder harbor village city road machine "
    "teacher student doctor farmer painter sailor kitchen table chair book lamp door wall roof field "
    "runs walks sings reads writes builds carries opens closes finds keeps brings watches follows "
    "under over near beyond inside across between during after before while because although and "
    "or but with without from into toward against among every many few some most other same "
    "careful gentle honest clever patient curious distant warm cold heavy light simple strange"
).split()


@dataclass(frozen=True)
class PromptSpec:
    """One request's input: the prompt text and how many tokens to ask for."""

    prompt: str
    max_tokens: int


@dataclass(frozen=True)
class LengthRange:
    """Inclusive uniform range ``[low, high]`` of positive integers."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not (isinstance(self.low, int) and isinstance(self.high, int)):
            raise ValueError(f"length range: bounds must be integers, got {self.low!r}:{self.high!r}")
        if self.low < 1 or self.high < self.low:
            raise ValueError(f"length range: need 1 <= MIN <= MAX, got {self.low}:{self.high}")


def parse_length_range(text: str, name: str) -> LengthRange:
    """Parse ``"N"`` or ``"MIN:MAX"``; ValueError naming ``name`` otherwise."""
    parts = text.split(":")
    try:
        values = [int(part) for part in parts]
    except ValueError:
        raise ValueError(f"{name}: expected N or MIN:MAX with integers, got {text!r}") from None
    if len(values) == 1:
        values = values * 2
    if len(values) != 2:
        raise ValueError(f"{name}: expected N or MIN:MAX, got {text!r}")
    try:
        return LengthRange(values[0], values[1])
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None


def synthetic_prompts(num_prompts: int, input_words: LengthRange, output_tokens: LengthRange,
                      seed: int) -> list[PromptSpec]:
    """``num_prompts`` seeded prompts; the same arguments always give the same list."""
    if not isinstance(num_prompts, int) or num_prompts < 1:
        raise ValueError(f"num_prompts: must be a positive integer, got {num_prompts!r}")
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        num_words = rng.randint(input_words.low, input_words.high)
        words = [rng.choice(VOCABULARY) for _ in range(num_words)]
        max_tokens = rng.randint(output_tokens.low, output_tokens.high)
        prompts.append(PromptSpec(" ".join(words), max_tokens))
    return prompts


def load_prompts_file(path: str | pathlib.Path, default_max_tokens: int) -> list[PromptSpec]:
    """Read a JSONL prompts file; ValueError naming the file and line for any bad entry."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"prompts_file: no such file {str(path)!r}")
    prompts = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"prompts_file {path.name}:{line_no}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not JSON ({err.msg})") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str):
            raise ValueError(f"{where}: expected an object with a string 'prompt'")
        max_tokens = entry.get("max_tokens", default_max_tokens)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"{where}: 'max_tokens' must be a positive integer, got {max_tokens!r}")
        prompts.append(PromptSpec(entry["prompt"], max_tokens))
    if not prompts:
        raise ValueError(f"prompts_file: {str(path)!r} holds no prompts")
    return prompts
