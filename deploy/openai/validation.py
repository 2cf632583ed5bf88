"""Request validation: OpenAI request models -> ``PreparedRequest`` objects the engine can run.

Everything here runs in the ingress before the engine is called, so a bad request never touches
engine state. Every failure raises ``APIError`` (400, or 404 for an unknown model) whose ``param``
names the offending field.

Decisions: docs/design/deploy.md, ``pagedray.deploy.openai.validation``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from pagedray.cluster.pooling import PoolingSettings
from pagedray.workers.contract.lora_request import LoRARequest
from pagedray.workers.contract.sampling_params import MAX_LOGPROBS, SamplingParams

from .errors import APIError, bad_request
from .lora_adapters import AdapterTable
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from .reasoning import HarmonyChannels, ReasoningStart, ThinkTags, grammar_after_reasoning
from .structured_output import requested_grammar
from .tool_parsers import keeps_special_tokens
from .tools import ToolPlan, calls_as_text, plan_tools, tool_grammar

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_BATCH_PROMPTS = 64
# one request may ask for at most this many full contexts of tokens: prompts x n x (prompt + max_tokens)
MAX_REQUEST_CONTEXTS = 16
# prompt logprob entries one request may ask for, in full contexts at the largest k (module docstring)
MAX_PROMPT_LOGPROB_CONTEXTS = 4


@dataclass(frozen=True)
class ModelLimits:
    """The served model's name and the bounds on its inputs (module docstring: input bounds)."""

    served_name: str
    aliases: frozenset[str]
    vocab_size: int
    max_model_len: int
    # a prompt with more characters cannot fit in max_model_len tokens (prompt_bound.py); None: unknown
    max_prompt_chars: int | None = None
    dtype: str | None = None     # the dtype the engine's ranks run, for /v1/models; None: not known
    # sequences (prompts x n) of one request in the engine at once (service.py); None: no bound.
    # The ingress sets half the engine's max_num_seqs.
    sequences_in_flight: int | None = None
    # the LoRA adapters served (lora_modules, and those loaded at run time): ``model`` may name one, alone or
    # as "<served name>:<adapter>". Given as (name, folder) pairs, kept as the (mutable) AdapterTable
    lora_adapters: AdapterTable | tuple = ()
    pooling: PoolingSettings = PoolingSettings()   # the pooling endpoints' settings (embeddings.py)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_adapters, AdapterTable):
            object.__setattr__(self, "lora_adapters", AdapterTable(self.lora_adapters))


@dataclass(frozen=True)
class PreparedRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...] = ()
    # the prompt's text, for echo (None when echo is off)
    echo_text: str | None = None
    # chat with tools: how the output becomes tool_calls (tools.py); None without tools
    tools: ToolPlan | None = None
    # chat with a reasoning parser: the tags and whether the prompt left a block open (reasoning.py)
    reasoning: ReasoningStart | None = None
    # the detokenizer keeps special tokens (a tool-call format whose marker is one: tool_parsers.py; a
    # reasoning format delimited by them: harmony, reasoning.py)
    keep_special_tokens: bool = False
    lora: LoRARequest | None = None     # the LoRA adapter ``model`` named (None: the base model)
    session: str | None = None          # prompt_cache_key: the session whose blocks stay cached


def _adapter_of(name: str, limits: ModelLimits) -> LoRARequest | None:
    base, sep, adapter = name.rpartition(":")
    return limits.lora_adapters.get(adapter if sep and base in limits.aliases else name)


def serves(name: str, limits: ModelLimits) -> bool:
    """Whether ``name`` is the model of ``limits`` or one of its LoRA adapters (alone or as "<model>:<adapter>")."""
    return name in limits.aliases or _adapter_of(name, limits) is not None


def check_model(name: str | None, limits: ModelLimits) -> LoRARequest | None:
    """The LoRA adapter ``name`` chooses (None: the base model, or no name); 404 for a name not served."""
    if name is None or name in limits.aliases:
        return None
    adapters = limits.lora_adapters
    lora = _adapter_of(name, limits)
    if lora is not None:
        return lora
    available = ", ".join(repr(n) for n in [limits.served_name, *adapters.names()])
    raise APIError(404, f"model: {name!r} is not served here; available: {available}",
                   "not_found_error", param="model", code="model_not_found")


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"{param}: token id {token_id} is outside the vocabulary [0, {vocab_size})",
                              param=param)


def _asks_nothing(value) -> bool:
    return value is None or value is False or value == [] or value == {} or value == ""


_GUIDED = "vLLM's older guided_* fields are not supported; use structured_outputs or response_format"
# OpenAI / vLLM request fields whose behaviour this server does not implement: field -> (the check that
# a value asks for nothing, why a value that asks for something is refused)
UNSUPPORTED_FIELDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "guided_json": (_asks_nothing, _GUIDED), "guided_regex": (_asks_nothing, _GUIDED),
    "guided_choice": (_asks_nothing, _GUIDED), "guided_grammar": (_asks_nothing, _GUIDED),
    "functions": (_asks_nothing, "function calling is not supported"),
    "function_call": (lambda v: v is None or v == "none", "function calling is not supported; only 'none'"),
    "suffix": (_asks_nothing, "not supported"),
    "audio": (_asks_nothing, "text output only"),
    "modalities": (lambda v: v is None or v == ["text"], "text output only; only ['text']"),
    "prediction": (_asks_nothing, "predicted outputs are not supported"),
    "web_search_options": (_asks_nothing, "web search is not supported"),
    "reasoning_effort": (_asks_nothing, "not supported"),
    "store": (_asks_nothing, "stored completions are not supported"),
}


# vLLM's chat-only extensions that would change the prompt or the output
CHAT_UNSUPPORTED_FIELDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "echo": (_asks_nothing, "not supported on chat"),
    "prompt_logprobs": (lambda v: v is None, "only on /v1/completions"),
    "add_special_tokens": (_asks_nothing, "not supported on chat (the chat template adds them)"),
    "chat_template": (_asks_nothing, "the model's own chat template is used"),
}
# vLLM's completion-only extension: the tokenizer's special tokens are always added
COMPLETION_UNSUPPORTED_FIELDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "add_special_tokens": (lambda v: v is None or v is True, "only true (the default) is supported"),
}


def check_fields(req: SamplingFields) -> None:
    """400 naming the first field (typed or extra) that asks for a behaviour this server does not
    implement (UNSUPPORTED_FIELDS and the endpoint's own table)."""
    extra = req.model_extra or {}
    own = CHAT_UNSUPPORTED_FIELDS if isinstance(req, ChatCompletionRequest) else COMPLETION_UNSUPPORTED_FIELDS
    for name, (asks_nothing, why) in {**UNSUPPORTED_FIELDS, **own}.items():
        value = extra.get(name) if name in extra else getattr(req, name, None)
        if not asks_nothing(value):
            raise bad_request(f"{name}: {why}", param=name)
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of: only best_of == n is supported", param="best_of")


# what apply_chat_template itself takes: a chat_template_kwargs key may not replace them
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
MAX_TEMPLATE_KWARGS = 32


def template_options(kwargs: dict | None, continue_final_message: bool, add_generation_prompt: bool,
                     messages: list[dict]) -> dict:
    """The template call's extra arguments: ``chat_template_kwargs`` (checked by ``template_kwargs``)
    and ``continue_final_message`` (vLLM's: the last message must be the assistant's, and no new
    assistant turn may be opened after it: 400 naming the field otherwise)."""
    options = template_kwargs(kwargs)
    if continue_final_message:
        if add_generation_prompt:
            raise bad_request("continue_final_message: cannot be combined with add_generation_prompt (set it "
                              "to false)", param="continue_final_message")
        if not messages or messages[-1]["role"] != "assistant":
            raise bad_request("continue_final_message: the last message must be the assistant's (the one to "
                              "continue)", param="continue_final_message")
        options["continue_final_message"] = True
    return options


def template_kwargs(kwargs: dict | None) -> dict:
    """``chat_template_kwargs``: the extra variables the chat template sees (Qwen3's ``enable_thinking``,
    ...). 400 naming the key for one that would replace an argument of the template call itself."""
    kwargs = kwargs or {}
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise bad_request(f"chat_template_kwargs: at most {MAX_TEMPLATE_KWARGS} keys, got {len(kwargs)}",
                          param="chat_template_kwargs")
    for key in kwargs:
        if not key.isidentifier() or key in RESERVED_TEMPLATE_KWARGS:
            raise bad_request(f"chat_template_kwargs.{key}: not a variable the chat template may take "
                              f"(reserved: the request's own fields set it)", param="chat_template_kwargs")
    return dict(kwargs)


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", param="stop")
    if any(s == "" for s in stops):
        raise bad_request("stop: stop strings must be non-empty", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        # the stop-string matcher holds back and rescans up to this many characters per token (event loop)
        raise bad_request(f"stop: a stop string may have at most {MAX_STOP_CHARS} characters", param="stop")
    return stops


def logit_bias_pairs(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` -> ``((token_id, bias), ...)``; 400 naming logit_bias otherwise."""
    pairs = []
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise bad_request(f"logit_bias: keys must be token ids (decimal strings), got {key!r}", param="logit_bias")
        token_id = int(key)
        if token_id >= vocab_size:
            raise bad_request(f"logit_bias: token id {token_id} is outside the vocabulary [0, {vocab_size})",
                              param="logit_bias")
        pairs.append((token_id, value))
    return tuple(pairs)


def requested_chat_grammar(req: SamplingFields, tools: ToolPlan | None = None) -> tuple[str, str] | None:
    """(field, llguidance grammar) the request asks for (response_format / structured_outputs, or a required /
    named tool choice), not yet compiled; None without."""
    requested = requested_grammar(req.model_extra or {})
    if tools is not None and tools.choice in ("required", "named"):
        if requested is not None:
            raise bad_request(f"tool_choice: a required or named tool choice cannot be combined with {requested[0]}",
                              param="tool_choice")
        requested = ("tool_choice", tool_grammar(tools))
    if requested is None:
        return None
    field = requested[0]
    if req.ignore_eos:
        raise bad_request(f"ignore_eos: cannot be combined with {field} (a finished grammar allows only EOS)",
                          param="ignore_eos")
    if req.min_tokens:
        raise bad_request(f"min_tokens: cannot be combined with {field} (min_tokens bans EOS)", param="min_tokens")
    return requested


def grammar_of(req: SamplingFields, check_grammar: Callable[[str, str], None] | None,
               tools: ToolPlan | None = None) -> str | None:
    """The request's llguidance grammar (``requested_chat_grammar``), checked; None without."""
    requested = requested_chat_grammar(req, tools)
    if requested is None:
        return None
    if check_grammar is not None:
        check_grammar(*requested)
    return requested[1]


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None,
                    vocab_size: int, grammar: str | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
    """Build SamplingParams from the request's fields (None -> the SamplingParams default)."""
    fields = {"n": req.n, "max_tokens": max_tokens, "ignore_eos": req.ignore_eos, "logprobs": logprobs,
              "prompt_logprobs": prompt_logprobs,
              "stop_token_ids": tuple(req.stop_token_ids or ()), "min_tokens": req.min_tokens,
              "logit_bias": logit_bias_pairs(req.logit_bias, vocab_size), "grammar": grammar,
              "speculative": req.speculative}
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed"):
        value = getattr(req, name)
        if value is not None:
            fields[name] = value
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        param = str(exc).split(":", 1)[0]
        raise bad_request(str(exc), param=param if param in SamplingFields.model_fields
                          or param == "logprobs" else None) from exc


def _check_max_tokens(value: int | None, prompt_len: int, limits: ModelLimits, param: str, default: int) -> int:
    if value is None:
        value = default
    elif value < 1:
        raise bad_request(f"{param}: must be a positive integer, got {value}", param=param)
    if prompt_len + value > limits.max_model_len:
        raise bad_request(
            f"{param}: prompt ({prompt_len} tokens) + {param} ({value}) exceeds the maximum context "
            f"length of {limits.max_model_len} tokens; shorten the prompt or lower {param}", param=param)
    return value


def _split_prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        prompts = [prompt]
    elif len(prompt) > 0 and isinstance(prompt[0], (str, list)):
        prompts = list(prompt)
    else:
        prompts = [prompt]
    if not prompts:
        raise bad_request("prompt: must not be empty", param="prompt")
    if len(prompts) > MAX_BATCH_PROMPTS:
        raise bad_request(f"prompt: at most {MAX_BATCH_PROMPTS} prompts per request", param="prompt")
    for one in prompts:
        if len(one) == 0:
            raise bad_request("prompt: must not be empty", param="prompt")
    return prompts


def check_prompt_tokens(num_tokens: int, limits: ModelLimits, param: str) -> None:
    """400 for a token-id list longer than the context, before its ids are looked at."""
    if num_tokens > limits.max_model_len:
        raise bad_request(f"{param}: {num_tokens} tokens exceed the maximum context length of "
                          f"{limits.max_model_len} tokens", param=param)


def check_chat_shape(messages, limits: ModelLimits, param: str = "messages") -> None:
    """400 for a raw (not yet parsed) ``messages`` list with more than ``max_model_len`` messages or
    content parts; reads at most that many entries. Shapes and types are left to the request model."""
    if not isinstance(messages, list):
        return
    bound = limits.max_model_len
    if len(messages) > bound:
        raise bad_request(f"{param}: {len(messages)} messages cannot fit in the maximum context length of "
                          f"{bound} tokens (each message takes at least one token)", param=param)
    parts = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        parts += len(content) if isinstance(content, list) else 0
        if parts > bound:
            raise bad_request(f"{param}: more than {bound} content parts (at most the maximum context "
                              "length)", param=param)


def check_prompt_chars(num_chars: int, limits: ModelLimits, param: str) -> None:
    """400 before tokenizing a text that cannot fit in the context (``limits.max_prompt_chars``)."""
    if limits.max_prompt_chars is not None and num_chars > limits.max_prompt_chars:
        raise bad_request(f"{param}: {num_chars} characters cannot fit in the maximum context length of "
                          f"{limits.max_model_len} tokens (at most {limits.max_prompt_chars} characters)",
                          param=param)


def prepare_completion(req: CompletionRequest, limits: ModelLimits, encode: Callable[[str], list[int]],
                       decode: Callable[[list[int]], str],
                       check_grammar: Callable[[str, str], None] | None = None) -> list[PreparedRequest]:
    """One PreparedRequest per prompt of a /v1/completions request (``decode``: token ids -> the text
    that ``echo`` shows for a token-id prompt)."""
    lora = check_model(req.model, limits)
    check_fields(req)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(req, name)
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise bad_request(f"{name}: must be in [0, {MAX_LOGPROBS}], got {value}", param=name)
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, req.logprobs)
    stops = stop_strings(req.stop)
    check_token_ids(list(req.stop_token_ids or ()), limits.vocab_size, "stop_token_ids")
    grammar = grammar_of(req, check_grammar)
    prompts = _split_prompts(req.prompt)
    for prompt in prompts:   # every prompt is checked before any is tokenized
        if isinstance(prompt, str):
            check_prompt_chars(len(prompt), limits, "prompt")
        else:
            check_prompt_tokens(len(prompt), limits, "prompt")
    prepared = []
    for prompt in prompts:
        token_ids = encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise bad_request("prompt: encodes to zero tokens", param="prompt")
        check_token_ids(token_ids, limits.vocab_size, "prompt")
        max_tokens = _check_max_tokens(req.max_tokens, len(token_ids), limits, "max_tokens", 16)
        params = sampling_params(req, max_tokens, req.logprobs, limits.vocab_size, grammar, prompt_logprobs)
        echo_text = None if not req.echo else prompt if isinstance(prompt, str) else decode(token_ids)
        prepared.append(PreparedRequest(token_ids, params, stops, echo_text, lora=lora,
                                        session=req.prompt_cache_key))
    _check_request_cost(prepared, limits)
    _check_prompt_logprobs_size(prepared, limits, "logprobs" if req.prompt_logprobs is None else "prompt_logprobs")
    return prepared


def _check_request_cost(prepared: list[PreparedRequest], limits: ModelLimits) -> None:
    """400 for a request whose token demand (prompts x n x (prompt + max_tokens)) is more than
    MAX_REQUEST_CONTEXTS full contexts: one request must not be able to fill the engine's queue alone."""
    cost = sum(p.params.n * (len(p.prompt_token_ids) + p.params.max_tokens) for p in prepared)
    limit = MAX_REQUEST_CONTEXTS * limits.max_model_len
    if cost > limit:
        raise bad_request(f"prompt: this request asks for {cost} tokens (prompts x n x (prompt + max_tokens)); "
                          f"at most {limit} ({MAX_REQUEST_CONTEXTS} x the maximum context length) are allowed "
                          "per request: send fewer prompts, a smaller n or max_tokens", param="prompt")


def _check_prompt_logprobs_size(prepared: list[PreparedRequest], limits: ModelLimits, param: str) -> None:
    """400 for a request whose prompt logprobs (sent once per choice) pass the response-size budget
    (module docstring); ``param``: the field that asked for them."""
    entries = sum(len(p.prompt_token_ids) * (p.params.prompt_logprobs + 1) * p.params.n
                  for p in prepared if p.params.prompt_logprobs is not None)
    limit = MAX_PROMPT_LOGPROB_CONTEXTS * limits.max_model_len * (MAX_LOGPROBS + 1)
    if entries > limit:
        raise bad_request(f"{param}: this request asks for {entries} prompt logprob entries (prompt tokens x "
                          f"(k + 1) x n); at most {limit} are allowed per request: lower {param}, n or the "
                          "number of prompts", param=param)


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs: requires logprobs=true", param="top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs: must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                              param="top_logprobs")
        return req.top_logprobs
    return 0 if req.logprobs else None


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """The request's messages as template input: text content; an assistant turn's tool calls appended
    in the Hermes form (tools.py)."""
    messages = []
    for m in req.messages:
        content = m.text()
        if m.tool_calls:
            content = (content + "\n" if content else "") + calls_as_text(m.tool_calls)
        messages.append({"role": m.role, "content": content})
    return messages


def prepare_chat(req: ChatCompletionRequest, limits: ModelLimits,
                 render: Callable[[list[dict], bool, ToolPlan | None, dict, bool], tuple[list[int], str, str]],
                 check_grammar: Callable[[str, str], None] | None = None,
                 reasoning: ThinkTags | HarmonyChannels | None = None,
                 tool_parser: str = "hermes") -> PreparedRequest:
    """Validate a /v1/chat/completions request; ``render`` applies the chat template and returns the prompt's
    token ids, its text and, when its last argument is true, the generation prompt's text; ``reasoning``: the
    reasoning parser's format (None: no parsing, reasoning.py);
    ``tool_parser``: the model's tool-call format (tool_parsers.py)."""
    lora = check_model(req.model, limits)
    check_fields(req)
    logprobs = chat_logprobs(req)
    stops = stop_strings(req.stop)
    check_token_ids(list(req.stop_token_ids or ()), limits.vocab_size, "stop_token_ids")
    extra = req.model_extra or {}
    tools = plan_tools(req.tools, extra.get("tool_choice"), extra.get("parallel_tool_calls"))
    if tools is not None:
        tools = replace(tools, parser=tool_parser)
    requested = requested_chat_grammar(req, tools)
    messages = chat_messages(req)
    check_prompt_chars(sum(len(m["content"]) for m in messages), limits, "messages")
    options = template_options(req.chat_template_kwargs, req.continue_final_message, req.add_generation_prompt,
                               messages)
    if req.documents is not None:
        check_prompt_chars(sum(len(k) + len(v) for d in req.documents for k, v in d.items()), limits, "documents")
        options["documents"] = [dict(d) for d in req.documents]
    token_ids, _, generation_prompt = render(messages, req.add_generation_prompt, tools, options, reasoning is not None)
    if not token_ids:
        raise bad_request("messages: the chat template produced an empty prompt", param="messages")
    if len(token_ids) >= limits.max_model_len:
        raise bad_request(f"messages: the prompt has {len(token_ids)} tokens, the maximum context length "
                          f"is {limits.max_model_len}", param="messages")
    # harmony reasoning before the harmony tool parser: the messages that are not reasoning reach it as written
    raw_messages = tools is not None and tools.choice == "auto" and tool_parser == "harmony"
    # only the text the template adds after the last message decides: a tag in a message is the user's text
    start = None if reasoning is None else ReasoningStart(reasoning, reasoning.prompt_opens(generation_prompt),
                                                          raw_messages)
    grammar = None
    if requested is not None:
        field, grammar = requested
        if start is not None:   # the grammar constrains the answer after the reasoning block
            grammar = grammar_after_reasoning(grammar, start)
        if check_grammar is not None:
            check_grammar(field, grammar)
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested_max = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = _check_max_tokens(requested_max, len(token_ids), limits, param,
                                   limits.max_model_len - len(token_ids))
    return PreparedRequest(token_ids, sampling_params(req, max_tokens, logprobs, limits.vocab_size, grammar), stops,
                           tools=tools, reasoning=start,
                           keep_special_tokens=tools is not None and keeps_special_tokens(tool_parser)
                           or start is not None and start.tags.keeps_special_tokens, lora=lora,
                           session=req.prompt_cache_key)
