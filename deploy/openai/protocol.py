"""OpenAI-compatible request and response models (pydantic v2).

Decisions: docs/design/deploy.md, ``pagedray.deploy.openai.protocol``.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

# str | token ids | batch of str | batch of token ids
PromptInput = Union[str, list[int], list[str], list[list[int]]]
# integer knobs must fit a signed 64-bit integer: the engine packs them into int64 tensors and msgpack
# (a 2**70 top_k or seed would otherwise fail inside an engine step, not here with a 400)
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingFields(_Request):
    """Sampling fields shared by /v1/completions and /v1/chat/completions (other fields: model_extra)."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: Int64 = 1
    best_of: Int64 | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    logit_bias: dict[str, float] | None = None
    speculative: bool = True     # pagedray: false opts out of the server's speculative decoding
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI's field: the session whose last prompt and output stay cached (block_manager/session_pins.py)
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=256)


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None
    prompt_logprobs: Int64 | None = None   # vLLM: logprobs of the prompt tokens, k alternatives each


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None     # an assistant turn's calls (tools.py renders them)
    tool_call_id: str | None = None          # a tool turn's answer to that call

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        # only an assistant turn may omit its content (OpenAI: tool-call turns); a user turn without text
        # is a client bug, not an empty prompt
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: required for a {self.role!r} message")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


MAX_DOCUMENTS = 64


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    tools: list[dict] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False       # leave the last (assistant) message open: the model continues it
    chat_template_kwargs: dict | None = None   # extra variables for the chat template (enable_thinking, ...)
    # RAG documents for a chat template that renders them (vLLM's / transformers' ``documents``)
    documents: list[dict[str, str]] | None = Field(default=None, max_length=MAX_DOCUMENTS)


class TokenizeCompletionRequest(_Request):
    """POST /tokenize with a prompt (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    """POST /tokenize with chat messages (vLLM's shape): the prompt the chat template renders."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Int64]


# ---------------------------------------------------------------- responses


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0   # prompt tokens served from the prefix cache


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0   # completion tokens of the reasoning block (chat with a reasoning parser)


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None   # set on chat with a reasoning parser
    kv_block_seconds: float = 0.0   # pagedray's: the KV blocks the request held, integrated over seconds

    @model_serializer(mode="wrap")
    def _without_unset_details(self, handler):
        """``completion_tokens_details`` is left out when it is None (responses without a reasoning parser
        keep their usage shape)."""
        data = handler(self)
        if data.get("completion_tokens_details", 0) is None:
            del data["completion_tokens_details"]
        return data


class CompletionLogprobs(BaseModel):
    """OpenAI legacy completions shape: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)   # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry: one token at one prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM: what stopped a "stop" choice: the stop string that matched, or the stop_token_ids entry; None
    # for EOS (and for every other finish)
    stop_reason: str | int | None = None
    # vLLM: per prompt token (None for the first) {token id: entry} of the prompt token and its top k;
    # left out of the JSON unless asked for (OpenAI's shape has no such key)
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None

    @model_serializer(mode="wrap")
    def _without_unasked_prompt_logprobs(self, handler):
        data = handler(self)
        if self.prompt_logprobs is None:
            data.pop("prompt_logprobs", None)
        return data


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict] | None = None
    # with a reasoning parser (reasoning.py): the thinking; the key is left out of responses without one
    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None   # as CompletionChoice's


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict] | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None   # on the finishing chunk (CompletionChoice's)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedray"
    max_model_len: int
    dtype: str | None = None      # the dtype the model runs in ("auto" resolved: dtype_choice.py)
    root: str | None = None       # a LoRA adapter's folder (vLLM's field)
    parent: str | None = None     # a LoRA adapter's base model (vLLM's field)

