"""OpenAI's harmony format (gpt-oss): what a completion looks like, and the tool-call states that read it.

After the generation prompt ``<|start|>assistant`` the model writes messages::

    <|channel|>analysis<|message|>thinking ...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>
    <|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>
    <|start|>assistant<|channel|>final<|message|>The answer.<|return|>

- A message is a header, ``<|message|>``, then its body up to ``<|end|>``, ``<|return|>`` or ``<|call|>``. The
  header starts at ``<|start|>`` (then the role) or, for the first message, right after the generation
  prompt: at ``<|channel|>``, or with `` to=...`` (the recipient written after the role). It holds
  ``<|channel|>NAME``, an optional recipient ``to=NAME`` (before or after the channel) and an optional
  content type (``json`` or ``<|constrain|>json``).
- The markers (``MARKERS``) are special tokens: the detokenizer keeps them for these readers, and neither
  lets one through into content, reasoning or arguments. A body also ends where a header starts (a model
  that skipped its end marker); a body's end marker may be missing at the end of the output (``<|call|>`` and
  ``<|return|>`` are end-of-sequence tokens that the detokenizer leaves out).
- What a message is (``message_kind``): a recipient ``functions.NAME`` makes it a call (its body is the
  arguments, a JSON object); otherwise the ``analysis`` channel is reasoning; everything else (``final``,
  ``commentary`` without a recipient, any other channel or recipient) is content. Text outside any message
  (a model that skipped its header) is content. A grammar (``response_format``, a required tool choice)
  constrains the final message's body (reasoning.py's ``grammar_after_reasoning``).

Two readers use this: reasoning.py's ``HarmonySplitter`` (analysis -> ``reasoning_content``) and the
``harmony`` tool-call parser, whose states are ``HarmonyCalls`` below (a part of tool_parsers.py's
``ToolCallStream``, which has the contract they keep).
"""

from __future__ import annotations

import re

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)
BODY_ENDS = (END, RETURN, CALL)
HEADER_STARTS = (START, CHANNEL)
_MARKER = re.compile("|".join(re.escape(m) for m in MARKERS))
_LONGEST = max(len(m) for m in MARKERS)
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([^\s<]*)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_LEAD = "to="                      # the first message's header may start with its recipient
_WS = re.compile(r"\s*")
FUNCTIONS = "functions."


def find_marker(text: str, pos: int, end: int | None = None) -> tuple[int, str | None]:
    """The first marker in ``text[pos:end]``: ``(where, marker)``; else ``(where, None)``: the text from
    ``where`` may still begin one (hold it), or ``where`` is ``end`` (no marker). Linear in what it reads."""
    end = len(text) if end is None else end
    m = _MARKER.search(text, pos, end)
    if m is not None:
        return m.start(), m.group()
    for k in range(min(_LONGEST - 1, end - pos), 0, -1):
        tail = text[end - k:end]
        if any(marker.startswith(tail) for marker in MARKERS):
            return end - k, None
    return end, None


def read_header(header: str) -> tuple[str | None, str | None]:
    """(channel, recipient) of a message header (the text before its ``<|message|>``); None where absent."""
    channel = _CHANNEL_NAME.search(header)
    recipient = _RECIPIENT.search(header)
    return (channel.group(1) or None) if channel else None, recipient.group(1) if recipient else None


def message_kind(channel: str | None, recipient: str | None) -> str:
    """``"call"`` (a recipient ``functions.NAME``), ``"reasoning"`` (the analysis channel) or ``"content"``."""
    if recipient is not None and recipient.startswith(FUNCTIONS):
        return "call"
    return "reasoning" if channel == "analysis" else "content"


def read_lead(text: str, pos: int, final: bool) -> tuple[bool | None, int]:
    """(whether an output that starts with whitespace up to ``pos`` and then ``text[pos:]`` starts inside its
    first header: `` to=functions.x<|channel|>...``, the generation prompt having ended after the role; None:
    too little text to tell yet, where its whitespace ends)."""
    pos = _WS.match(text, pos).end()
    head = text[pos:pos + len(_LEAD)]
    if head == _LEAD:
        return True, pos
    return (None if not final and len(head) < len(_LEAD) and _LEAD.startswith(head) else False), pos


def prompt_opens_analysis(prompt: str) -> bool:
    """Whether a generation prompt ends inside an analysis message's body (its last ``<|message|>`` is not
    followed by an end marker or a header, and its header names the analysis channel)."""
    at = prompt.rfind(MESSAGE)
    if at < 0 or any(prompt.find(m, at) >= 0 for m in (*BODY_ENDS, START)):
        return False
    header = prompt[max(prompt.rfind(START, 0, at), 0):at]
    return message_kind(*read_header(header)) == "reasoning"


class HarmonyCalls:
    """The ``harmony`` format's states of tool_parsers.py's ``ToolCallStream`` (a mixin: it reads and writes
    the stream's fields and calls its helpers; see there).

    ``_h_lead`` decides whether the output starts inside a header (``_mark``: its start); ``_h_body``
    reads a body (or text outside messages), sending it as content when ``_h_content`` (else dropping it:
    analysis) up to the next marker; ``_h_header`` reads a header from ``_mark`` to its ``<|message|>``;
    ``_h_call`` waits for the ``{`` that makes a message to a known function a call (``_mark``: where its
    body began); the stream's ``_arguments`` then sends the object, cut at the next marker (``_h_limit``),
    and ``_h_swallow`` drops the rest of the body. Markers are never content: a header cut short or
    abandoned (a ``<|start|>`` before its ``<|message|>``) is dropped, and so is a stray ``<|message|>``
    or ``<|constrain|>``."""

    HARMONY_HOLDS_MARK = frozenset({"_h_lead", "_h_header", "_h_call"})

    def _h_lead(self) -> bool:
        """The output's start (from ``_mark``, whitespace read up to ``_pos``): inside a header, or a body."""
        lead, self._pos = read_lead(self._text, self._pos, final=False)
        if lead is None:
            return False
        self._pos = self._mark
        return self._goto(self._h_header if lead else self._h_body)

    def _h_body(self) -> bool:
        text, pos = self._text, self._pos
        where, marker = find_marker(text, pos)
        if self._h_content:
            self._content_text(text[pos:where])
        self._pos = where
        if marker is None:
            return False
        self._pos = where + len(marker)
        if marker in HEADER_STARTS:
            self._mark = where
            return self._goto(self._h_header)
        if marker in BODY_ENDS:
            self._h_content = True           # text outside messages is content
        return True

    def _h_header(self) -> bool:
        text = self._text
        where, marker = find_marker(text, self._pos)
        self._pos = where if marker is None else where + len(marker)
        if marker is None:
            return False
        if marker == START:                  # a new header: the one read so far is dropped
            self._mark = where
        elif marker in BODY_ENDS:            # a message without a body: dropped
            self._h_content = True
            return self._goto(self._h_body)
        elif marker == MESSAGE:
            channel, recipient = read_header(text[self._mark:where])
            kind = message_kind(channel, recipient)
            name = recipient[len(FUNCTIONS):] if kind == "call" else None
            if name in self._names:
                self._name, self._mark = name, self._pos
                return self._goto(self._h_call)
            self._h_content = kind != "reasoning"    # an unknown function's body stays content
            return self._goto(self._h_body)
        return True                          # <|channel|>, <|constrain|>: the header goes on

    def _h_call(self) -> bool:
        """A message to a known function: a call when its body is a JSON object, else the body is content."""
        if not self._skip_ws():
            return False
        if self._text[self._pos] != "{":
            self._pos, self._h_content = self._mark, True
            return self._goto(self._h_body)
        self._commit(self._name)
        self._scan, self._mark = self._new_scan(), self._pos
        return self._goto(self._arguments)

    def _h_limit(self, read: int) -> tuple[int, bool]:
        """Where a call's arguments must stop: (the next marker or a held piece of one, whether it is one)."""
        where, marker = find_marker(self._text, read)
        return where, marker is not None

    def _h_swallow(self) -> bool:
        """After a call's arguments: the rest of its body is dropped up to the next marker."""
        where, marker = find_marker(self._text, self._pos)
        self._pos = where
        if marker is None:
            return False
        self._h_content = True
        if marker in HEADER_STARTS or marker in BODY_ENDS:
            return self._goto(self._h_body)
        self._pos = where + len(marker)
        return True

    def _h_finish(self) -> None:
        """At the end of the output: a content body's held text (a marker's beginning) is content; a header
        cut short is dropped; a message to a function with only whitespace in its body: that whitespace."""
        if self._state == self._h_body and self._h_content or self._state == self._h_call:
            self._content_text(self._text[self._pos if self._state == self._h_body else self._mark:])
        elif self._state == self._h_lead:
            self._content_text(self._text[self._mark:])
