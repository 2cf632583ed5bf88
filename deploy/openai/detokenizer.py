"""Incremental detokenization and stop-string detection for streamed generation.

IncrementalDetokenizer turns a growing list of token ids into text deltas:
- Each step decodes only a short window: ``ids[prefix_offset:]`` against ``ids[prefix_offset:read_offset]``
  and emits the difference, so the cost per token does not grow with the output length.
- The window starts on the last few prompt tokens, so tokenizers that drop a leading space when a
  token is decoded alone (SentencePiece) still produce the right first word.
- A token that ends in the middle of a multi-byte UTF-8 character decodes to ``"\\ufffd"``; such
  deltas are held until the character is complete. ``flush()`` releases whatever is left at the end.
- Invariant (byte-level BPE and SentencePiece tokenizers): the concatenation of every delta plus
  ``flush()`` equals ``tokenizer.decode(all_output_ids, skip_special_tokens=True)``.

StopStringMatcher scans that text for stop strings:
- Text that could be the start of a stop string is held back (never streamed to the client) until
  the next delta proves it is not one; on a match, the text is cut just before the stop string and
  the stop string itself is never emitted (the OpenAI behaviour).
- The stop that *completes first* wins (smallest end position; among stops ending at the same place,
  the one starting earliest), as if the text arrived one character at a time: generation would have
  stopped there, so a longer stop string that only completes later never counts. This makes the
  result independent of how the text is split into deltas.
- Invariant: the concatenation of everything emitted is the full text cut before the first-completed
  stop string (or the full text when there is none, after ``flush()``).
"""

from __future__ import annotations

from collections.abc import Sequence

PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated tokens; return the text they complete (may be empty)."""
        out = []
        for token_id in token_ids:
            self._ids.append(int(token_id))
            prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
            new_text = self._decode(self._ids[self._prefix_offset:])
            if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
                out.append(new_text[len(prefix_text):])
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._ids)
        return "".join(out)

    def flush(self) -> str:
        """Text of trailing tokens still held back (an unfinished UTF-8 character decodes as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""


class StopStringMatcher:
    def __init__(self, stop: Sequence[str]) -> None:
        if any(not isinstance(s, str) or s == "" for s in stop):
            raise ValueError(f"stop: stop strings must be non-empty strings, got {list(stop)!r}")
        self._stops = tuple(stop)
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, delta: str) -> str:
        """Add new text; return the part that is safe to emit now. Sets ``stopped`` on a match."""
        if self.stopped:
            return ""
        buffer = self._pending + delta
        cut, matched = self._first_completed_match(buffer)
        if matched is not None:
            self.stopped, self.matched, self._pending = True, matched, ""
            return buffer[:cut]
        held = self._held_suffix_length(buffer)
        self._pending = buffer[len(buffer) - held:] if held else ""
        return buffer[:len(buffer) - held]

    def flush(self) -> str:
        """The held-back text, once generation has ended without a match."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _first_completed_match(self, text: str) -> tuple[int, str | None]:
        """(start, stop) of the stop occurrence that ends first in ``text`` (ties: earliest start)."""
        best, best_stop = (len(text) + 1, 0), None
        for stop in self._stops:
            at = text.find(stop)
            if at != -1 and (at + len(stop), at) < best:
                best, best_stop = (at + len(stop), at), stop
        return best[1], best_stop

    def _held_suffix_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if stop.startswith(text[len(text) - length:]):
                    longest = length
                    break
        return longest
