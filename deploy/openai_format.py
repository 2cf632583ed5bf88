"""ChoiceDelta streams -> OpenAI response objects (completions and chat; whole and chunked).

Decisions:
- Logprob token strings are ``tokenizer.decode([token_id])`` with special tokens kept, so the EOS
  token shows as ``<|im_end|>``; ``bytes`` are that string's UTF-8 bytes.
- Completions ``top_logprobs`` is the OpenAI legacy dict ``{token: logprob}`` of the k best
  alternatives (``logprobs=k``); ``text_offset`` counts characters from the start of the returned
  text (echoed prompt included).
- Chat streams open each choice with ``{"role": "assistant", "content": ""}`` and send the finish
  reason in a chunk of its own when it arrives with no text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedray.cluster.outputs import TokenLogprob

from .generation import ChoiceDelta
from .protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    TopLogprob,
    UsageInfo,
)


class LogprobFormatter:
    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(self, logprobs: list[TokenLogprob], text_offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for entry in logprobs:
            token = self.token(entry.token_id)
            out.tokens.append(token)
            out.token_logprobs.append(entry.logprob)
            out.top_logprobs.append({self.token(t): lp for t, lp in entry.top_logprobs})
            out.text_offset.append(text_offset)
            text_offset += len(token)
        return out

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.token(token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))

    def chat(self, logprobs: list[TokenLogprob]) -> ChatLogprobs:
        content = []
        for entry in logprobs:
            top = self._top(entry.token_id, entry.logprob)
            content.append(ChatTokenLogprob(token=top.token, logprob=top.logprob, bytes=top.bytes,
                                            top_logprobs=[self._top(t, lp) for t, lp in entry.top_logprobs]))
        return ChatLogprobs(content=content)


@dataclass
class ChoiceAccumulator:
    """Collects one choice's deltas for a non-streaming response."""

    prefix: str = ""
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None

    def add(self, delta: ChoiceDelta) -> None:
        self.text.append(delta.text)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason

    @property
    def full_text(self) -> str:
        return self.prefix + "".join(self.text)


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def completion_response(rid: str, created: int, model: str, choices: list[ChoiceAccumulator],
                        fmt: LogprobFormatter, use: UsageInfo, want_logprobs: bool) -> CompletionResponse:
    out = []
    for index, acc in enumerate(choices):
        logprobs = fmt.completion(acc.logprobs or [], len(acc.prefix)) if want_logprobs else None
        out.append(CompletionChoice(index=index, text=acc.full_text, logprobs=logprobs,
                                    finish_reason=acc.finish_reason))
    return CompletionResponse(id=rid, created=created, model=model, choices=out, usage=use)


def completion_chunk(rid: str, created: int, model: str, index: int, text: str,
                     logprobs: CompletionLogprobs | None, finish_reason: str | None) -> CompletionResponse:
    choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason)
    return CompletionResponse(id=rid, created=created, model=model, choices=[choice])


def chat_response(rid: str, created: int, model: str, choices: list[ChoiceAccumulator],
                  fmt: LogprobFormatter, use: UsageInfo, want_logprobs: bool) -> ChatCompletionResponse:
    out = [ChatChoice(index=index, message=ChatResponseMessage(content=acc.full_text),
                      logprobs=fmt.chat(acc.logprobs or []) if want_logprobs else None,
                      finish_reason=acc.finish_reason)
           for index, acc in enumerate(choices)]
    return ChatCompletionResponse(id=rid, created=created, model=model, choices=out, usage=use)


def chat_chunk(rid: str, created: int, model: str, index: int, delta: ChatDelta,
               logprobs: ChatLogprobs | None = None, finish_reason: str | None = None) -> dict:
    """A chat chunk as a dict; the delta omits unset fields (``{"content": "..."}``), as OpenAI's does."""
    choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
    chunk = ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice]).model_dump()
    chunk["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
    return chunk


def usage_chunk_completion(rid: str, created: int, model: str, use: UsageInfo) -> CompletionResponse:
    return CompletionResponse(id=rid, created=created, model=model, choices=[], usage=use)


def usage_chunk_chat(rid: str, created: int, model: str, use: UsageInfo) -> ChatCompletionChunk:
    return ChatCompletionChunk(id=rid, created=created, model=model, choices=[], usage=use)
