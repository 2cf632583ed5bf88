"""Reasoning ("thinking") output on chat: the text between ``<think>`` and ``</think>`` becomes the
message's ``reasoning_content``, the text after it ``content`` (vLLM's ``--reasoning-parser`` for the
Qwen3 and DeepSeek-R1 formats); or, for gpt-oss, the harmony ``analysis`` channel becomes
``reasoning_content`` and the ``final`` channel ``content`` (harmony.py has the format).

The contract:

- Parser: the ``reasoning_parser`` option. ``auto`` (the default) is ``harmony`` when the chat template's
  source holds ``<|channel|>`` (gpt-oss), else ``think`` when it holds both tags (Qwen3, DeepSeek-R1 and
  their distills), else ``none``; ``think`` forces it (``qwen3`` and ``deepseek_r1`` are accepted as its
  names), ``harmony`` the channels; ``none`` leaves the output untouched.
- Where a choice starts: inside the reasoning when the generation prompt (the text the template adds after
  the last message: ``generation_prompt_of``) ends in an open block (its last ``<think>`` comes after its
  last ``</think>``: DeepSeek-R1 and Qwen3 thinking-2507 templates put ``<think>\\n`` there), else in
  content, where a ``<think>`` that opens the output (after whitespace) starts the reasoning (Qwen3). Only
  that text decides: a tag inside a message (user, system, tool or document text, an earlier answer) is
  text the user controls, and it once moved the split (and with it the grammar's wrapper). A Qwen3 prompt
  rendered with ``chat_template_kwargs: {"enable_thinking": false}`` ends in the closed empty block, so its
  output is content.
- The split: reasoning = the text after the opening tag up to the closing tag; content = the text after
  the closing tag. The tags are dropped, and so is the whitespace right after each tag and right before
  the closing one (templates write ``<think>\\n ... \\n</think>\\n\\n``). Only the first block counts: a
  later ``<think>`` is content. A choice that never enters a block is content byte for byte, as without a
  parser. A choice that ends inside the block (``max_tokens``) has reasoning and ``content`` null.
- Streaming: ``ReasoningSplitter`` consumes the text deltas and holds back only what may still turn out
  to be (part of) a tag or whitespace to drop, so a tag is found when it spans tokens; the non-streamed
  message is the same splitter fed the whole text, so the concatenated streamed pieces equal it.
- Reasoning tokens (``usage.completion_tokens_details.reasoning_tokens``): the tokens of the deltas that
  reached the splitter while it was in, or took it into, the reasoning (the tags' tokens included).
- Grammars (``response_format``, ``structured_outputs``, a required or named tool choice) constrain the
  answer, not the thinking: a choice that may reason gets its grammar wrapped (``grammar_after_reasoning``:
  any text up to the closing tag, optional whitespace, then the request's grammar).
- Tool calls are parsed from the content only (a call written while thinking is reasoning text).

harmony (``HarmonySplitter``; the markers are special tokens, so ``keeps_special_tokens``: the detokenizer
keeps them for any request, with tools or not):

- The split: the bodies of ``analysis`` messages (without a ``functions.`` recipient) are the reasoning,
  several joined by ``"\n"``; the bodies of the other messages (``final``, ``commentary``, calls) and any
  text outside messages are the content, concatenated. No marker or header reaches either, and bodies are
  not stripped. A choice starts outside any message (the generation prompt ``<|start|>assistant`` leaves
  the first header to the model, which may begin with the recipient: `` to=functions.x<|channel|>...``), or
  in the reasoning when the generation prompt ends inside an analysis body (``prompt_opens``). A choice
  that never writes an analysis message has ``reasoning_content`` null, as with tags.
- With the ``harmony`` tool-call parser on the request (``ReasoningStart.raw_messages``), every message but
  the reasoning's reaches the content as written, markers and headers included, so that the tool parser
  (tool_parsers.py) reads the calls and the ``final`` text from it; the reasoning is split as above.
- Reasoning tokens: as with tags (the tokens of the deltas read while in an analysis message).
- Grammars constrain the ``final`` message's body: the wrapped grammar (``grammar_after_reasoning``) lets the
  model write any number of whole analysis messages first (free text between their markers, which the
  grammar names as special tokens), then requires ``<|channel|>final<|message|>`` and the request's grammar; a
  generation prompt that ends inside an analysis body starts the output in it. The answer reaches the content
  and the analysis the reasoning, as without a grammar.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import ClassVar

from .harmony import (
    BODY_ENDS,
    CHANNEL,
    END,
    HEADER_STARTS,
    MESSAGE,
    START,
    find_marker,
    message_kind,
    prompt_opens_analysis,
    read_header,
    read_lead,
)

REASONING_PARSERS = ("auto", "think", "none", "harmony")
PARSER_ALIASES = {"qwen3": "think", "deepseek_r1": "think"}
ANSWER_GRAMMAR = "pagedray_answer"   # the request's own grammar, referenced from the wrapper


@dataclass(frozen=True)
class ThinkTags:
    start: str = "<think>"
    end: str = "</think>"
    keeps_special_tokens: ClassVar[bool] = False   # the tags are text (or tokens the detokenizer shows)

    def prompt_opens(self, prompt: str) -> bool:
        """True when ``prompt`` ends inside an open block (its last start tag after its last end tag)."""
        return prompt.rfind(self.start) > prompt.rfind(self.end)


def generation_prompt_of(with_prompt: str, without_prompt: str) -> str:
    """The text a chat template adds after the last message: the rendering with the generation prompt past
    the rendering without it; "" when the first does not extend the second (a template that renders the
    conversation differently with a generation prompt: no open block is assumed, and an output that opens
    with a tag still starts the reasoning)."""
    return with_prompt[len(without_prompt):] if with_prompt.startswith(without_prompt) else ""


@dataclass(frozen=True)
class HarmonyChannels:
    """The harmony reasoning format (gpt-oss): the analysis channel is the reasoning (module docstring)."""

    keeps_special_tokens: ClassVar[bool] = True    # every message is delimited by special tokens

    def prompt_opens(self, prompt: str) -> bool:
        """True when ``prompt`` ends inside an analysis message's body."""
        return prompt_opens_analysis(prompt)


def resolve_reasoning_parser(name: str, chat_template: str | None) -> ThinkTags | HarmonyChannels | None:
    """The format for option value ``name`` (``auto`` looks at the template source); None: no parsing."""
    name = PARSER_ALIASES.get(name, name)
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser: {name!r} is not one of {', '.join(REASONING_PARSERS)} "
                         f"(or {', '.join(PARSER_ALIASES)})")
    tags = ThinkTags()
    if name == "auto":
        source = chat_template or ""
        if "<|channel|>" in source:
            return HarmonyChannels()
        return tags if tags.start in source and tags.end in source else None
    return {"think": tags, "harmony": HarmonyChannels()}.get(name)


@dataclass(frozen=True)
class ReasoningStart:
    """One chat request's reasoning setup: the tags, and whether its prompt left a block open;
    ``raw_messages`` (harmony): the messages that are not reasoning reach the content as written, for the
    harmony tool-call parser (module docstring)."""

    tags: ThinkTags | HarmonyChannels
    opened: bool
    raw_messages: bool = False


_BEFORE, _REASONING, _CONTENT = "before", "reasoning", "content"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    """One choice's text -> (reasoning, content) pieces, incrementally (module docstring)."""

    def __init__(self, start: ReasoningStart) -> None:
        self._tags = start.tags
        self._state = _REASONING if start.opened else _BEFORE
        self.entered = start.opened          # the choice has (had) a reasoning block
        self._held = ""
        self._trim = start.opened            # drop whitespace at the start of the current section
        self.touched = False                 # was in the reasoning during a feed (reset by the caller)

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        """What is still held, at the end of the choice."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        while True:
            if self._state == _BEFORE:
                stripped = self._held.lstrip()
                if stripped.startswith(self._tags.start):
                    self._held = stripped[len(self._tags.start):]
                    self._state, self.entered, self._trim = _REASONING, True, True
                    continue
                if self._tags.start.startswith(stripped) and not final:
                    break                        # whitespace or a tag's beginning: not decided yet
                self._state = _CONTENT
                continue
            self.touched |= self._state == _REASONING
            if self._trim:
                self._held = self._held.lstrip()
                if not self._held:
                    break
                self._trim = False
            if self._state == _CONTENT:
                content.append(self._held)
                self._held = ""
                break
            end = self._held.find(self._tags.end)
            if end >= 0:
                reasoning.append(self._held[:end].rstrip())
                self._held = self._held[end + len(self._tags.end):]
                self._state, self._trim = _CONTENT, True
                continue
            if final:
                reasoning.append(self._held.rstrip())
                self._held = ""
                break
            keep = _partial_suffix(self._held, self._tags.end)
            sure = self._held[:len(self._held) - keep]
            body = sure.rstrip()                 # trailing whitespace waits: it may precede the end tag
            reasoning.append(body)
            self._held = self._held[len(body):]
            break
        return "".join(reasoning), "".join(content)


class HarmonySplitter:
    """One choice's harmony text -> (reasoning, content) pieces, incrementally (module docstring), with the
    same interface as ``ReasoningSplitter``. States: ``lead`` (the output's start, from ``_mark``: is it
    inside the first header?), ``header`` (from ``_mark`` to its ``<|message|>``), ``body`` (a message's
    body, or text outside messages: reasoning when ``_reasoning``, else content). ``_text`` keeps only
    what is undecided."""

    def __init__(self, start: ReasoningStart) -> None:
        self._raw = start.raw_messages
        self._state = "body" if start.opened else "lead"
        self._reasoning = start.opened
        self.entered = start.opened
        self.touched = False
        self._text, self._pos, self._mark = "", 0, 0
        self._reasoned = False               # some reasoning was sent: a later analysis message gets "\n"
        self._separate = False               # the current analysis message is a later one

    def feed(self, text: str) -> tuple[str, str]:
        self._text += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        while self._step(final, reasoning, content):
            pass
        keep = min(self._pos, self._mark) if self._state in ("lead", "header") else self._pos
        self._text, self._pos, self._mark = self._text[keep:], self._pos - keep, self._mark - keep
        return "".join(reasoning), "".join(content)

    def _body_text(self, piece: str, reasoning: list[str], content: list[str]) -> None:
        if not piece:
            return
        if not self._reasoning:
            content.append(piece)
            return
        if self._separate and self._reasoned:
            reasoning.append("\n")
        self._separate, self._reasoned = False, True
        reasoning.append(piece)

    def _step(self, final: bool, reasoning: list[str], content: list[str]) -> bool:
        """Read on from ``_pos``; whether to go on."""
        text, pos = self._text, self._pos
        self.touched |= self._state == "body" and self._reasoning
        if self._state == "lead":            # from _mark; its whitespace read up to _pos
            lead, self._pos = read_lead(text, pos, final)
            if lead is None:
                return False
            self._state, self._pos = "header" if lead else "body", self._mark
            return True
        where, marker = find_marker(text, pos)
        if marker is None and final:
            where = len(text)
        if self._state == "body":
            self._body_text(text[pos:where], reasoning, content)
            self._pos = where
            if marker is None:
                return False
            self._pos = where + len(marker)
            if marker in HEADER_STARTS:
                self._state, self._mark = "header", where
            elif self._raw and not self._reasoning:
                content.append(marker)       # the tool parser reads the message's end (or drops a stray one)
            if marker in BODY_ENDS:
                self._reasoning = False      # text outside messages is content
            return True
        if marker is None:                   # a header not finished yet (at the end: cut short)
            self._pos = where
            if final and self._raw:
                content.append(text[self._mark:where])   # the tool parser drops it too
            return False
        self._pos = where + len(marker)
        if marker == START:                  # a new header: the one before is dropped
            if self._raw:
                content.append(text[self._mark:where])
            self._mark = where
        elif marker in BODY_ENDS:            # a message without a body
            if self._raw:
                content.append(text[self._mark:self._pos])
            self._state, self._reasoning = "body", False
        elif marker == MESSAGE:
            self._reasoning = message_kind(*read_header(text[self._mark:where])) == "reasoning"
            if self._reasoning:
                self.entered = self.touched = self._separate = True
            elif self._raw:
                content.append(text[self._mark:self._pos])
            self._state = "body"
        return True


def make_splitter(start: ReasoningStart) -> ReasoningSplitter | HarmonySplitter:
    return HarmonySplitter(start) if isinstance(start.tags, HarmonyChannels) else ReasoningSplitter(start)


@dataclass
class SplitMessage:
    """A whole choice's text split (the non-streamed message)."""

    reasoning: str | None
    content: str | None


class ReasoningTracker:
    """One choice's splitter and its reasoning-token count (module docstring), fed per engine delta.
    ``keep``: also keep the pieces for ``message`` (the non-streamed response; a stream sends them on)."""

    def __init__(self, start: ReasoningStart, keep: bool = True) -> None:
        self.splitter = make_splitter(start)
        self.tokens = 0
        self._undecided = 0          # tokens seen before the choice's first text decided the state
        self._keep = keep
        self.reasoning: list[str] = []
        self.content: list[str] = []

    def feed(self, text: str, num_tokens: int, last: bool) -> tuple[str, str]:
        """(reasoning, content) pieces this delta releases; ``last``: the choice's final delta."""
        self.splitter.touched = False
        reasoning, content = self.splitter.feed(text)
        if last:
            more_reasoning, more_content = self.splitter.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        if self.splitter.touched:
            self.tokens += self._undecided + num_tokens
            self._undecided = 0
        elif self.splitter.entered:
            self._undecided = 0
        else:
            self._undecided += num_tokens
        if self._keep:
            self.reasoning.append(reasoning)
            self.content.append(content)
        return reasoning, content

    def message(self) -> SplitMessage:
        """The whole choice (everything fed so far, ``last`` given): None for an empty part, and content
        None beside reasoning only when the choice entered a block."""
        reasoning, content = "".join(self.reasoning), "".join(self.content)
        if not self.splitter.entered:
            return SplitMessage(None, content)
        return SplitMessage(reasoning or None, content or None)


def split_text(text: str, start: ReasoningStart) -> SplitMessage:
    """A whole choice's text split in one go (the same splitter as the streams)."""
    tracker = ReasoningTracker(start)
    tracker.feed(text, 0, last=True)
    return tracker.message()


def grammar_after_reasoning(grammar: str, start: ReasoningStart) -> str:
    """``grammar`` (llguidance's JSON form) allowing a reasoning block before it: from an open block,
    any text up to the end tag; otherwise an optional block that opens the output; then optional
    whitespace and the original grammar (referenced as a named sub-grammar). harmony: whole analysis messages,
    then the final channel's header and the original grammar as its body (module docstring)."""
    top = json.loads(grammar)               # built by this server (structured_output.py, tools.py)
    grammars = top["grammars"]
    answer = {**grammars[0], "name": ANSWER_GRAMMAR}
    if isinstance(start.tags, HarmonyChannels):
        return json.dumps({**top, "grammars": [{"lark_grammar": _harmony_rules(start.opened)}, answer, *grammars[1:]]})
    end = re.escape(start.tags.end).replace("/", "\\/")
    think = f"think[lazy]: /(?s:.*){end}/"
    if start.opened:
        rules = f"start: think WS? @{ANSWER_GRAMMAR}"
    else:
        rules = f"start: (OPEN think WS?)? @{ANSWER_GRAMMAR}\nOPEN: {json.dumps(start.tags.start)}"
    lark = f"{rules}\nWS: /[ \\t\\r\\n]+/\n{think}"
    return json.dumps({**top, "grammars": [{"lark_grammar": lark}, answer, *grammars[1:]]})


def _harmony_rules(opened: bool) -> str:
    """The lark rules of a harmony output whose final body is ``@ANSWER_GRAMMAR``: llguidance reads ``<|...|>``
    as one special token of the tokenizer, and THINK (any text) cannot contain one, so each analysis body ends at
    its ``<|end|>``. ``opened``: the output starts inside an analysis body (``prompt_opens``)."""
    next_message = f'{END} {START} "assistant"'
    analysis = f'{CHANNEL} "analysis" {MESSAGE} THINK {next_message}'
    first = f"THINK {next_message} " if opened else ""
    return (f'start: {first}analysis* {CHANNEL} "final" {MESSAGE} @{ANSWER_GRAMMAR}\n'
            f"analysis: {analysis}\nTHINK: /(?s:.*)/")
