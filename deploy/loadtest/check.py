"""``--check``: greedy responses under load must equal a reference run of the same prompts.

Decisions: docs/design/deploy.md, ``pagedray.deploy.loadtest.check``.
"""

from __future__ import annotations

import difflib
import json
import pathlib
from dataclasses import dataclass

from pagedray.deploy.loadtest.prompts import PromptSpec
from pagedray.deploy.loadtest.record import RequestRecord

CAUSE_LOST = "check_lost"
CAUSE_DUPLICATED = "check_duplicated"
CAUSE_CORRUPTED = "check_corrupted"
MAX_EXAMPLES = 5


@dataclass(frozen=True)
class ReferenceOutput:
    text: str
    chunks: tuple[str, ...] | None = None


ReferenceKey = tuple[str, int]


def reference_from_records(prompts: list[PromptSpec], records: list[RequestRecord]) -> dict:
    """References from a completed (sequential) run; failed requests give no reference."""
    out = {}
    for record in records:
        if record.ok:
            spec = prompts[record.prompt_index]
            out[(spec.prompt, spec.max_tokens)] = ReferenceOutput(record.text, tuple(record.chunks))
    return out


def load_reference(path: str | pathlib.Path) -> dict[ReferenceKey, ReferenceOutput]:
    """Read a reference file; ValueError naming ``reference`` for a bad one."""
    path = pathlib.Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"reference: cannot read {str(path)!r}: {err}") from None
    entries = data.get("outputs") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"reference: {str(path)!r} must hold an object with an 'outputs' list")
    out = {}
    for i, entry in enumerate(entries):
        if not (isinstance(entry, dict) and isinstance(entry.get("prompt"), str)
                and isinstance(entry.get("max_tokens"), int) and isinstance(entry.get("text"), str)):
            raise ValueError(f"reference: outputs[{i}] needs string 'prompt', int 'max_tokens', string 'text'")
        chunks = entry.get("chunks")
        if isinstance(chunks, list) and "".join(chunks) != entry["text"]:
            raise ValueError(f"reference: outputs[{i}] 'chunks' do not join to its 'text'")
        out[(entry["prompt"], entry["max_tokens"])] = ReferenceOutput(
            entry["text"], tuple(chunks) if isinstance(chunks, list) else None)
    return out


def save_reference(path: str | pathlib.Path, reference: dict[ReferenceKey, ReferenceOutput]) -> None:
    outputs = [{"prompt": prompt, "max_tokens": max_tokens, "text": ref.text,
                "chunks": list(ref.chunks) if ref.chunks is not None else None}
               for (prompt, max_tokens), ref in reference.items()]
    pathlib.Path(path).write_text(json.dumps({"outputs": outputs}, indent=1), encoding="utf-8")


def classify_mismatch(expected: list[str], got: list[str]) -> tuple[str, str]:
    """(cause, detail) for the first difference between two piece lists that are not equal."""
    matcher = difflib.SequenceMatcher(a=expected, b=got, autojunk=False)
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal":
            continue
        where = f"at piece {a0}"
        if tag == "delete":
            return CAUSE_LOST, f"{where}: {a1 - a0} piece(s) missing, expected {expected[a0:a1][:3]!r}"
        if tag == "insert":
            extra = got[b0:b1]
            before = got[max(b0 - len(extra), 0):b0]
            after = got[b1:b1 + len(extra)]
            if extra in (before, after):
                return CAUSE_DUPLICATED, f"{where}: {b1 - b0} piece(s) repeated: {extra[:3]!r}"
            return CAUSE_CORRUPTED, f"{where}: unexpected piece(s) {extra[:3]!r}"
        return CAUSE_CORRUPTED, f"{where}: expected {expected[a0:a1][:3]!r}, got {got[b0:b1][:3]!r}"
    raise ValueError("expected/got: the piece lists are equal, there is no mismatch to classify")


def check_records(prompts: list[PromptSpec], records: list[RequestRecord],
                  reference: dict[ReferenceKey, ReferenceOutput]) -> dict:
    """Compare every completed record with its reference; mismatches become failures. Returns a summary."""
    checked = unchecked = 0
    examples = []
    for record in records:
        if not record.ok:
            continue
        spec = prompts[record.prompt_index]
        expected = reference.get((spec.prompt, spec.max_tokens))
        if expected is None:
            unchecked += 1
            continue
        checked += 1
        if record.text == expected.text:
            continue
        if expected.chunks is not None:
            cause, detail = classify_mismatch(list(expected.chunks), list(record.chunks))
        else:
            cause, detail = classify_mismatch(list(expected.text), list(record.text))
        record.fail(cause, detail)
        if len(examples) < MAX_EXAMPLES:
            examples.append({"index": record.index, "prompt_index": record.prompt_index,
                             "cause": cause, "detail": detail})
    mismatched = sum(1 for r in records if r.error in (CAUSE_LOST, CAUSE_DUPLICATED, CAUSE_CORRUPTED))
    return {"checked": checked, "mismatched": mismatched, "unchecked": unchecked, "examples": examples}
