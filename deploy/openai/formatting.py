"""ChoiceDelta streams -> OpenAI response objects (completions and chat; whole and chunked).

Decisions: docs/design/deploy.md, ``pagedray.deploy.openai.formatting``.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field

from pagedray.cluster.outputs import TokenLogprob

from .protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionTokensDetails,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)
from .reasoning import ReasoningTracker
from .streaming import ChoiceDelta
from .token_bytes import TokenBytes
from .tools import ToolPlan, parse_tool_calls


class TextOffsets:
    """One choice's running character count: ``start`` characters (the echoed prompt), then the
    characters that the tokens' bytes complete (a split character counts once, when it completes)."""

    def __init__(self, start: int = 0) -> None:
        self.chars = start
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def advance(self, raw: bytes) -> int:
        """The offset before ``raw``; then count the characters it completes."""
        before = self.chars
        self.chars += len(self._decoder.decode(raw))
        return before


class LogprobFormatter:
    def __init__(self, tokenizer) -> None:
        self._bytes = TokenBytes(tokenizer)

    def token(self, token_id: int) -> str:
        return self._bytes.text(token_id)

    def _append(self, out: CompletionLogprobs, token_id: int, entry: TokenLogprob | None,
                offsets: TextOffsets) -> None:
        """One token of the legacy lists; ``entry`` None (an echoed prompt's first token): null logprobs."""
        out.tokens.append(self.token(token_id))
        out.token_logprobs.append(None if entry is None else entry.logprob)
        top: dict[str, float] | None = None
        if entry is not None:
            top = {}
            for alt_id, logprob in entry.top_logprobs:
                top.setdefault(self.token(alt_id), logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offsets.advance(self._bytes.bytes(token_id)))

    def completion(self, logprobs: list[TokenLogprob], offsets: TextOffsets) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for entry in logprobs:
            self._append(out, entry.token_id, entry, offsets)
        return out

    def echoed_prompt(self, prompt_token_ids: list[int], entries: list[TokenLogprob | None],
                      then: CompletionLogprobs) -> CompletionLogprobs:
        """The legacy lists of the echoed prompt (offsets from 0) followed by ``then``'s."""
        out, offsets = CompletionLogprobs(), TextOffsets()
        for token_id, entry in zip(prompt_token_ids, entries):
            self._append(out, token_id, entry, offsets)
        out.tokens += then.tokens
        out.token_logprobs += then.token_logprobs
        out.top_logprobs += then.top_logprobs
        out.text_offset += then.text_offset
        return out

    def prompt_logprobs(self, entries: list[TokenLogprob | None]) -> list[dict[str, dict] | None]:
        """vLLM's prompt_logprobs as JSON values (``PromptLogprob``'s fields): per prompt token its own
        entry, then its top k (ranks 1..k)."""
        out: list[dict[str, dict] | None] = []
        for entry in entries:
            if entry is None:
                out.append(None)
                continue
            position = {str(entry.token_id): {"logprob": entry.logprob, "rank": entry.rank,
                                              "decoded_token": self.token(entry.token_id)}}
            for rank, (token_id, logprob) in enumerate(entry.top_logprobs, start=1):
                position.setdefault(str(token_id), {"logprob": logprob, "rank": rank,
                                                    "decoded_token": self.token(token_id)})
            out.append(position)
        return out

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        return TopLogprob(token=self.token(token_id), logprob=logprob, bytes=list(self._bytes.bytes(token_id)))

    def chat(self, logprobs: list[TokenLogprob]) -> ChatLogprobs:
        content = []
        for entry in logprobs:
            top = self._top(entry.token_id, entry.logprob)
            content.append(ChatTokenLogprob(token=top.token, logprob=top.logprob, bytes=top.bytes,
                                            top_logprobs=[self._top(t, lp) for t, lp in entry.top_logprobs]))
        return ChatLogprobs(content=content)


class PromptLogprobsOnce:
    """Formats each prompt's prompt logprobs once; the choices of a prompt share the result. The engine
    side sends one list object per prompt to all of its choices, so the list's identity is the key (the
    memo keeps the list alive, so an id is never reused while it is here)."""

    def __init__(self, fmt: LogprobFormatter) -> None:
        self._fmt = fmt
        self._done: dict[int, tuple[list, list]] = {}

    def __call__(self, entries: list[TokenLogprob | None]) -> list[dict[str, dict] | None]:
        done = self._done.get(id(entries))
        if done is None:
            done = self._done[id(entries)] = (entries, self._fmt.prompt_logprobs(entries))
        return done[1]


def prompt_logprob_weight(entries: list | None, k: int | None) -> int:
    """How many prompt logprob entries formatting ``entries`` with top ``k`` makes (0 without)."""
    return 0 if entries is None or k is None else len(entries) * (k + 1)


@dataclass
class ChoiceAccumulator:
    """Collects one choice's deltas for a non-streaming response."""

    prefix: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    reasoning: ReasoningTracker | None = None   # chat with a reasoning parser: splits the text as it comes
    stop_reason: str | int | None = None

    def add(self, delta: ChoiceDelta) -> None:
        self.text.append(delta.text)
        if self.reasoning is not None:
            self.reasoning.feed(delta.text, len(delta.token_ids), delta.finish_reason is not None)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason

    @property
    def full_text(self) -> str:
        return self.prefix + "".join(self.text)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          reasoning_tokens: int | None = None, kv_block_seconds: float = 0.0) -> UsageInfo:
    """``reasoning_tokens``: set (also 0) on chat with a reasoning parser, None elsewhere."""
    details = None if reasoning_tokens is None else CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
                     completion_tokens_details=details, kv_block_seconds=round(kv_block_seconds, 6))


def completion_response(rid: str, created: int, model: str, choices: list[ChoiceAccumulator],
                        fmt: LogprobFormatter, use: UsageInfo, want_logprobs: bool, echo: bool = False,
                        want_prompt_logprobs: bool = False) -> dict:
    """The response as a JSON dict. ``echo`` with ``want_logprobs``: the prompt's logprobs lead the
    choice's; prompt logprobs are formatted once per prompt and shared (module docstring)."""
    out, shared, once = [], [], PromptLogprobsOnce(fmt)
    for index, acc in enumerate(choices):
        logprobs = fmt.completion(acc.logprobs or [], TextOffsets(len(acc.prefix))) if want_logprobs else None
        entries = acc.prompt_logprobs or [None] * len(acc.prompt_token_ids)
        if want_logprobs and echo:
            logprobs = fmt.echoed_prompt(acc.prompt_token_ids, entries, logprobs)
        out.append(CompletionChoice(index=index, text=acc.full_text, logprobs=logprobs,
                                    finish_reason=acc.finish_reason, stop_reason=acc.stop_reason))
        shared.append(once(entries) if want_prompt_logprobs else None)
    return _with_prompt_logprobs(CompletionResponse(id=rid, created=created, model=model, choices=out,
                                                    usage=use).model_dump(), shared)


def _with_prompt_logprobs(body: dict, per_choice: list[list | None]) -> dict:
    """Put each choice's (shared) prompt logprobs into the dumped body, where the field's key goes."""
    for choice, prompt_logprobs in zip(body["choices"], per_choice):
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs
    return body


# Stream chunks are built as the JSON dicts they become, one per token and choice: the same keys and
# values as dumping the protocol's CompletionResponse / ChatCompletionChunk (a test holds them equal),
# without building and dumping those models on the per-token path.

def completion_chunk(rid: str, created: int, model: str, index: int, text: str,
                     logprobs: CompletionLogprobs | None, finish_reason: str | None,
                     prompt_logprobs: list | None = None, stop_reason: str | int | None = None) -> dict:
    """A completion chunk as a JSON dict (``prompt_logprobs``: the prompt's shared list, not copied)."""
    choice = {"index": index, "text": text, "logprobs": None if logprobs is None else logprobs.model_dump(),
              "finish_reason": finish_reason, "stop_reason": stop_reason}
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice],
            "usage": None}


def _tool_message(text: str, tools: ToolPlan | None,
                  finish_reason: str | None) -> tuple[ChatResponseMessage, str | None]:
    if tools is None:
        return ChatResponseMessage(content=text), finish_reason
    content, calls = parse_tool_calls(text, tools)
    if calls and finish_reason == "stop":
        finish_reason = "tool_calls"
    return ChatResponseMessage(content=content, tool_calls=calls or None), finish_reason


def chat_response(rid: str, created: int, model: str, choices: list[ChoiceAccumulator], fmt: LogprobFormatter,
                  use: UsageInfo, want_logprobs: bool, tools: ToolPlan | None = None) -> dict:
    """The response as a JSON dict; with a reasoning parser each message also has ``reasoning_content``
    and tool calls are parsed from the content alone."""
    out, reasoning = [], []
    for index, acc in enumerate(choices):
        text, thought = acc.full_text, None
        if acc.reasoning is not None:
            split = acc.reasoning.message()
            text, thought = split.content, split.reasoning
        if text is None:
            message, finish_reason = ChatResponseMessage(content=None), acc.finish_reason
        else:
            message, finish_reason = _tool_message(text, tools, acc.finish_reason)
        out.append(ChatChoice(index=index, message=message, finish_reason=finish_reason,
                              stop_reason=acc.stop_reason if finish_reason == "stop" else None,
                              logprobs=fmt.chat(acc.logprobs or []) if want_logprobs else None))
        reasoning.append((acc.reasoning is not None, thought))
    body = ChatCompletionResponse(id=rid, created=created, model=model, choices=out, usage=use).model_dump()
    for choice, (parsed, thought) in zip(body["choices"], reasoning):
        if parsed:
            choice["message"]["reasoning_content"] = thought
        else:
            del choice["message"]["reasoning_content"]
    return body


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict,
               logprobs: ChatLogprobs | None = None, finish_reason: str | None = None,
               stop_reason: str | int | None = None) -> dict:
    """A chat chunk as a dict. ``delta``: the fields this chunk sets (``role``, ``content``,
    ``tool_calls``), unset ones left out (``{"content": "..."}``), as OpenAI's deltas do."""
    choice = {"index": index, "delta": delta, "logprobs": None if logprobs is None else logprobs.model_dump(),
              "finish_reason": finish_reason, "stop_reason": stop_reason}
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice],
            "usage": None}


def usage_chunk_completion(rid: str, created: int, model: str, use: UsageInfo) -> CompletionResponse:
    return CompletionResponse(id=rid, created=created, model=model, choices=[], usage=use)


def usage_chunk_chat(rid: str, created: int, model: str, use: UsageInfo) -> ChatCompletionChunk:
    return ChatCompletionChunk(id=rid, created=created, model=model, choices=[], usage=use)
