"""OpenAIService: the transport-free core of the ingress (used by the HTTP routes and the handle API).

A request goes: body dict -> pydantic model (400 on shape/type errors) -> ``PreparedRequest`` per
prompt (validation.py; 400/404) -> engine streams (one per prompt, merged) -> the first engine
output is awaited (so 429/503 surface before any response starts) -> OpenAI objects as dicts.

Streams are returned as async iterators of dicts *after* that first output has arrived; closing one
early (client disconnect, handle cancellation) closes the engine streams, which aborts the requests.

Parsing, validation, chat-template rendering and tokenizing (``prepare``; /tokenize and /detokenize
too) run on the prepare lanes' worker threads (prepare_lanes.py), never on the event loop: a short
request waits only behind other short ones, and each prepare thread encodes with its own tokenizer copy.
Every input a prepare thread handles is bounded before the work it bounds (validation.py: input
bounds), and the rendered chat prompt is checked against ``max_prompt_chars`` before it is tokenized,
which bounds how long one request holds a thread.

A non-streamed response with many logprob entries (``BIG_RESPONSE_ENTRIES``: prompt logprobs, long
logprob lists) is built on a worker thread (``asyncio.to_thread``), as are a stream's chunks that carry
a big prompt's logprobs, so ``/health`` and other streams are not held while it is built; http/routes.py
encodes the JSON off the event loop too. Prompt logprobs are formatted once per prompt and shared by
its choices (formatting.py).

A request with several prompts sends them to the engine at most ``limits.sequences_in_flight // n`` at
a time (half the engine's ``max_num_seqs``, set by the ingress; at least one; the next prompt goes when
one finishes), so one batch request cannot take every engine seat and leave other clients' requests
waiting behind its whole batch. Admission errors of the later prompts (429) then arrive mid-response,
like any engine error after the first output.

Metrics: every request is counted once in ``pagedray:requests_total`` by outcome; token counts and
latencies are recorded for every request that was admitted (also when it was aborted).
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable

from jinja2.exceptions import TemplateError, TemplateSyntaxError
from pagedray.workers.contract.lora_request import LoRARequest
from pydantic import ValidationError

from .errors import bad_request, to_api_error
from .formatting import (
    ChoiceAccumulator,
    LogprobFormatter,
    PromptLogprobsOnce,
    TextOffsets,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    prompt_logprob_weight,
    usage,
    usage_chunk_chat,
    usage_chunk_completion,
)
from .lora_adapters import LoadLoraAdapterRequest, UnloadLoraAdapterRequest, adapter_to_load, adapter_to_unload
from .metrics import ServerMetrics
from .prepare_lanes import PrepareLanes, off_loop_if
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from .reasoning import ReasoningTracker, generation_prompt_of, resolve_reasoning_parser
from .streaming import EngineClient, PrefetchedStream, RequestTimer, merge_streams, stream_choices
from .structured_output import GrammarChecker
from .tool_parsers import ToolCallStream
from .tools import ToolPlan, resolve_tool_call_parser, template_knows_tools, with_tools_prompt
from .validation import (
    ModelLimits,
    PreparedRequest,
    check_chat_shape,
    check_model,
    check_prompt_chars,
    check_prompt_tokens,
    check_token_ids,
    prepare_chat,
    prepare_completion,
    template_options,
)


def parse_body(model_cls, body):
    """Validate a decoded JSON body against a request model; APIError 400 naming the field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = str(first["loc"][0]) if first["loc"] else None
        where = ".".join(str(part) for part in first["loc"])
        raise bad_request(f"{where}: {first['msg']}", param=param) from None


def _usage(timer: RequestTimer, reasoning_tokens: int | None = None):
    return usage(timer.prompt_tokens, timer.completion_tokens, timer.cached_prompt_tokens, reasoning_tokens,
                 timer.kv_block_seconds)


def outcome_of(exc: BaseException) -> str:
    api = to_api_error(exc)
    if api.status in (429, 503):
        return "rejected"
    return "invalid" if 400 <= api.status < 500 else "error"


class _Run:
    """One admitted request: its id, timer, prepared prompts and merged engine stream."""

    def __init__(self, rid: str, prepared: list[PreparedRequest], stream: PrefetchedStream,
                 timer: RequestTimer) -> None:
        self.rid, self.prepared, self.stream, self.timer = rid, prepared, stream, timer
        self.created = int(time.time())
        self.n = prepared[0].params.n
        self.finish_reasons: list[str] = []
        self._on_close = None

    def on_close(self, callback) -> None:
        self._on_close = callback

    async def close(self, outcome: str) -> None:
        """Close the engine streams (aborting unfinished requests) and record the outcome, once."""
        callback, self._on_close = self._on_close, None
        await self.stream.aclose()
        if callback is not None:
            callback(outcome)


class ChunkStream:
    """Async iterator of response chunks; ``aclose()`` aborts the run even if it was never iterated."""

    def __init__(self, chunks: AsyncIterator[dict], run: _Run) -> None:
        self._chunks, self._run = chunks, run

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> dict:
        return await anext(self._chunks)

    async def aclose(self) -> None:
        await self._chunks.aclose()
        await self._run.close("abort")


class _CompletionChunks:
    """Builds a completion stream's chunks: each choice's text offsets and pending echo; its prompt's
    logprobs formatted once and shared by the prompt's choices."""

    def __init__(self, req: CompletionRequest, run: _Run, fmt: LogprobFormatter, model: str) -> None:
        self.req, self.run, self.fmt, self.model = req, run, fmt, model
        self.offsets = [TextOffsets(len(p.echo_text or "")) for p in run.prepared for _ in range(run.n)]
        self.pending_echo = [p.echo_text or "" for p in run.prepared for _ in range(run.n)]
        self.prompts = [p.prompt_token_ids for p in run.prepared for _ in range(run.n)]
        self.once = PromptLogprobsOnce(fmt)

    def chunk(self, index: int, delta) -> dict | None:
        """The chunk for one delta of choice ``index``; None when it has nothing to send."""
        req, fmt = self.req, self.fmt
        text, self.pending_echo[index] = self.pending_echo[index] + delta.text, ""
        logprobs = prompt_logprobs = None
        if req.logprobs is not None:
            logprobs = fmt.completion(delta.logprobs or [], self.offsets[index])
        if delta.prompt_logprobs is not None:   # the choice's first delta
            if req.echo and logprobs is not None:
                logprobs = fmt.echoed_prompt(self.prompts[index], delta.prompt_logprobs, logprobs)
            if req.prompt_logprobs is not None:
                prompt_logprobs = self.once(delta.prompt_logprobs)
        if text or delta.finish_reason or (logprobs and logprobs.tokens) or prompt_logprobs:
            return completion_chunk(self.run.rid, self.run.created, self.model, index, text, logprobs,
                                    delta.finish_reason, prompt_logprobs, delta.stop_reason)
        return None


# a response with more logprob entries than this is built on a worker thread (a few ms of work below it)
BIG_RESPONSE_ENTRIES = 4096


class OpenAIService:
    def __init__(self, engine: EngineClient, tokenizer, limits: ModelLimits, metrics: ServerMetrics,
                 reasoning_parser: str = "auto", tool_call_parser: str = "auto") -> None:
        """``reasoning_parser``: ``auto``, ``think`` or ``none`` (reasoning.py); ``tool_call_parser``: ``auto``
        or a format of tool_parsers.py (tools.py ``resolve_tool_call_parser``); ValueError naming either."""
        self.reasoning = resolve_reasoning_parser(reasoning_parser, getattr(tokenizer, "chat_template", None))
        self.tool_parser = resolve_tool_call_parser(tool_call_parser, tokenizer)
        self._lanes = PrepareLanes(tokenizer)
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = limits
        self.metrics = metrics
        self.logprob_format = LogprobFormatter(tokenizer)
        # run-time adapter loading: refused (with this reason) where a table of this replica's would not be the
        # app's (several ingress replicas: lora_adapters.py)
        self.lora_refusal: str | None = None
        self.grammars = GrammarChecker(tokenizer)
        self.scorer = None   # cluster.pooling.Scorer of this model, built by the first rerank / score (embeddings.py)

    # ------------------------------------------------------------------ plumbing
    @property
    def _tok(self):
        """The calling prepare thread's own tokenizer (prepare_lanes.py)."""
        return self._lanes.tokenizer

    def _encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def _decode_prompt(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=False)

    def _render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                     tools: ToolPlan | None = None, template_kwargs: dict | None = None,
                     with_generation_prompt: bool = False) -> tuple[list[int], str, str]:
        """The chat template's prompt, tokenized, its text, and (``with_generation_prompt``) the text the template
        adds after the last message (``generation_prompt_of``; "" otherwise); a rendered text too long for the
        context is refused before tokenizing. ``template_kwargs``: the checked extra arguments
        (``template_options``). A template that refuses the conversation (its ``raise_exception``) is a 400
        with its message."""
        tokenizer = self._tok
        if not getattr(tokenizer, "chat_template", None):
            raise bad_request("messages: this model has no chat template; use /v1/completions",
                              param="messages")
        kwargs = dict(template_kwargs or {})
        if "documents" in kwargs and "documents" not in tokenizer.chat_template:
            raise bad_request("documents: this model's chat template does not render documents", param="documents")
        if tools is not None and template_knows_tools(tokenizer):
            kwargs["tools"] = [{"type": "function", "function": f} for f in tools.tools]
        elif tools is not None:
            messages = with_tools_prompt(messages, tools)
        def render(generation_prompt: bool) -> str:
            try:
                return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                     tokenize=False, **kwargs)
            except TemplateSyntaxError:
                raise                         # the model's template is broken: a server fault, not the request's
            except TemplateError as exc:
                raise bad_request(f"messages: the chat template refused the request: {exc}",
                                  param="messages") from None
        text = render(add_generation_prompt)
        check_prompt_chars(len(text), self.limits, "messages")
        suffix = generation_prompt_of(text, render(False)) if with_generation_prompt and add_generation_prompt else ""
        return tokenizer.encode(text, add_special_tokens=False), text, suffix

    async def _admit(self, prefix: str, prepared: list[PreparedRequest], tenant: str | None = None) -> _Run:
        rid = f"{prefix}-{uuid.uuid4().hex}"
        timer = RequestTimer()
        streams = [stream_choices(self.engine, f"{rid}-{i}", p, self.tokenizer, timer, tenant)
                   for i, p in enumerate(prepared)]
        bound = self.limits.sequences_in_flight
        window = None if bound is None else max(1, bound // prepared[0].params.n)
        stream = PrefetchedStream(merge_streams(streams, window))
        try:
            await stream.prefetch()
        except BaseException:
            await stream.aclose()
            raise
        return _Run(rid, prepared, stream, timer)

    def _finish(self, run: _Run, endpoint: str, outcome: str) -> None:
        """Record a finished run's outcome, token counts and latencies."""
        m, t = self.metrics, run.timer
        m.record_outcome(endpoint, outcome)
        m.prompt_tokens.inc(t.prompt_tokens)
        m.generation_tokens.inc(t.completion_tokens)
        if t.first_token is not None:
            m.ttft.observe(t.first_token - t.arrival)
            m.e2e.observe(t.last_token - t.arrival)
        for gap in t.inter_token:
            m.inter_token.observe(gap)

    async def _deltas(self, run: _Run) -> AsyncIterator[tuple[int, object]]:
        """The run's (global choice index, ChoiceDelta) pairs; records the outcome when it ends."""
        outcome = "abort"
        try:
            async for prompt_index, deltas in run.stream:
                for delta in deltas:
                    if delta.finish_reason is not None:
                        run.finish_reasons.append(delta.finish_reason)
                    yield prompt_index * run.n + delta.index, delta
            outcome = "length" if "length" in run.finish_reasons else "stop"
        except Exception as exc:
            outcome = outcome_of(exc)
            raise
        finally:
            await run.close(outcome)

    async def _open(self, endpoint: str, prefix: str, prepare: Callable, body,
                    tenant: str | None = None) -> tuple[object, _Run]:
        """Parse + validate (``prepare(body)``, on the body's prepare lane), then admit (for ``tenant``: the
        caller's, from its API key); any failure is counted and raised as APIError."""
        try:
            req, prepared = await self._lanes.call(prepare, body)
            run = await self._admit(prefix, prepared, tenant)
        except Exception as exc:
            self.metrics.record_outcome(endpoint, outcome_of(exc))
            raise to_api_error(exc) from exc
        run.on_close(lambda outcome: self._finish(run, endpoint, outcome))
        return req, run

    def _answering(self, run: _Run) -> str:
        """The ``model`` a response names: the LoRA adapter the request chose, else the served name."""
        lora = run.prepared[0].lora
        return self.limits.served_name if lora is None else lora.name

    # ------------------------------------------------------------------ completions
    def _prepare_completion(self, body: dict) -> tuple[CompletionRequest, list[PreparedRequest]]:
        req = parse_body(CompletionRequest, body)
        return req, prepare_completion(req, self.limits, self._encode, self._decode_prompt, self.grammars.check)

    async def completion(self, body: dict, tenant: str | None = None) -> dict:
        req, run = await self._open("completions", "cmpl", self._prepare_completion, body, tenant)
        accs = [ChoiceAccumulator(prefix=p.echo_text or "", prompt_token_ids=p.prompt_token_ids)
                for p in run.prepared for _ in range(run.n)]
        async for index, delta in self._deltas(run):
            accs[index].add(delta)
        use = _usage(run.timer)
        params = run.prepared[0].params
        weight = sum(prompt_logprob_weight(a.prompt_logprobs, params.prompt_logprobs)
                     + prompt_logprob_weight(a.logprobs, params.logprobs) for a in accs)
        return await off_loop_if(weight > BIG_RESPONSE_ENTRIES, functools.partial(
            completion_response, run.rid, run.created, self._answering(run), accs, self.logprob_format, use,
            req.logprobs is not None, req.echo, req.prompt_logprobs is not None))

    async def open_completion_stream(self, body: dict, tenant: str | None = None) -> ChunkStream:
        req, run = await self._open("completions", "cmpl", self._prepare_completion, body, tenant)
        return ChunkStream(self._completion_chunks(req, run), run)

    async def _completion_chunks(self, req: CompletionRequest, run: _Run) -> AsyncIterator[dict]:
        chunks = _CompletionChunks(req, run, self.logprob_format, self._answering(run))
        k = run.prepared[0].params.prompt_logprobs
        async for index, delta in self._deltas(run):
            # a choice's first delta carries its prompt's logprobs: a big one is formatted off the loop
            big = prompt_logprob_weight(delta.prompt_logprobs, k) > BIG_RESPONSE_ENTRIES
            chunk = await off_loop_if(big, functools.partial(chunks.chunk, index, delta))
            if chunk is not None:
                yield chunk
        if req.stream_options is not None and req.stream_options.include_usage:
            use = _usage(run.timer)
            yield usage_chunk_completion(run.rid, run.created, chunks.model, use).model_dump()

    # ------------------------------------------------------------------ chat
    def _prepare_chat(self, body: dict) -> tuple[ChatCompletionRequest, list[PreparedRequest]]:
        if isinstance(body, dict):
            check_chat_shape(body.get("messages"), self.limits)   # before parsing a huge list
        req = parse_body(ChatCompletionRequest, body)
        return req, [prepare_chat(req, self.limits, self._render_chat, self.grammars.check, self.reasoning,
                                  self.tool_parser)]

    async def chat(self, body: dict, tenant: str | None = None) -> dict:
        req, run = await self._open("chat", "chatcmpl", self._prepare_chat, body, tenant)
        start = run.prepared[0].reasoning
        accs = [ChoiceAccumulator(reasoning=None if start is None else ReasoningTracker(start)) for _ in range(run.n)]
        async for index, delta in self._deltas(run):
            accs[index].add(delta)
        use = _usage(run.timer, None if start is None else sum(acc.reasoning.tokens for acc in accs))
        weight = sum(prompt_logprob_weight(a.logprobs, run.prepared[0].params.logprobs) for a in accs)
        return await off_loop_if(weight > BIG_RESPONSE_ENTRIES, functools.partial(
            chat_response, run.rid, run.created, self._answering(run), accs, self.logprob_format, use,
            req.logprobs, run.prepared[0].tools))

    async def open_chat_stream(self, body: dict, tenant: str | None = None) -> ChunkStream:
        req, run = await self._open("chat", "chatcmpl", self._prepare_chat, body, tenant)
        return ChunkStream(self._chat_chunks(req, run), run)

    async def _chat_chunks(self, req: ChatCompletionRequest, run: _Run) -> AsyncIterator[dict]:
        model, rid, created = self._answering(run), run.rid, run.created
        for index in range(run.n):
            yield chat_chunk(rid, created, model, index, {"role": "assistant", "content": ""})
        tools, start = run.prepared[0].tools, run.prepared[0].reasoning
        trackers = [None if start is None else ReasoningTracker(start, keep=False) for _ in range(run.n)]
        calls = [None if tools is None else ToolCallStream(tools, tools.parser) for _ in range(run.n)]
        async for index, delta in self._deltas(run):
            logprobs = self.logprob_format.chat(delta.logprobs or []) if req.logprobs else None
            finished = delta.finish_reason is not None
            reasoning, content = "", delta.text
            if trackers[index] is not None:
                reasoning, content = trackers[index].feed(delta.text, len(delta.token_ids), finished)
            if calls[index] is not None:   # tool calls: content and calls as the parser releases them
                if reasoning:
                    yield chat_chunk(rid, created, model, index, {"reasoning_content": reasoning})
                for fields in calls[index].feed(content) + (calls[index].finish() if finished else []):
                    yield chat_chunk(rid, created, model, index, fields)
                if finished:
                    reason = "tool_calls" if calls[index].made_calls and delta.finish_reason == "stop" \
                        else delta.finish_reason
                    yield chat_chunk(rid, created, model, index, {}, finish_reason=reason,
                                     stop_reason=delta.stop_reason if reason == "stop" else None)
                continue
            if reasoning or content or finished or (logprobs and logprobs.content):
                fields = {"reasoning_content": reasoning} if reasoning else {}
                if content:
                    fields["content"] = content
                yield chat_chunk(rid, created, model, index, fields, logprobs, delta.finish_reason, delta.stop_reason)
        if req.stream_options is not None and req.stream_options.include_usage:
            use = _usage(run.timer, None if start is None else sum(t.tokens for t in trackers))
            yield usage_chunk_chat(rid, created, model, use).model_dump()

    # ------------------------------------------------------------------ tokenizer endpoints
    def _tokenize(self, body) -> dict:
        """The same bounds as generation: a prompt's characters, a chat's messages, parts and rendered text."""
        if isinstance(body, dict) and "messages" in body:
            check_chat_shape(body["messages"], self.limits)
            chat = parse_body(TokenizeChatRequest, body)
            check_model(chat.model, self.limits)
            messages = [{"role": m.role, "content": m.text()} for m in chat.messages]
            check_prompt_chars(sum(len(m["content"]) for m in messages), self.limits, "messages")
            options = template_options(chat.chat_template_kwargs, chat.continue_final_message,
                                       chat.add_generation_prompt, messages)
            token_ids, _, _ = self._render_chat(messages, chat.add_generation_prompt, None, options)
            with_strs = chat.return_token_strs
        else:
            req = parse_body(TokenizeCompletionRequest, body)
            check_model(req.model, self.limits)
            check_prompt_chars(len(req.prompt), self.limits, "prompt")
            token_ids = self._tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
            with_strs = req.return_token_strs
        strs = self._tok.convert_ids_to_tokens(token_ids) if with_strs else None
        return TokenizeResponse(count=len(token_ids), max_model_len=self.limits.max_model_len, tokens=token_ids,
                                token_strs=strs).model_dump()

    def _detokenize(self, body) -> dict:
        """At most ``max_model_len`` token ids (counted before the list is parsed), like a prompt."""
        if isinstance(body, dict) and isinstance(body.get("tokens"), list):
            check_prompt_tokens(len(body["tokens"]), self.limits, "tokens")
        req = parse_body(DetokenizeRequest, body)
        check_model(req.model, self.limits)
        check_token_ids(req.tokens, self.limits.vocab_size, "tokens")
        return DetokenizeResponse(prompt=self._decode_prompt(req.tokens)).model_dump()

    async def _on_prepare_thread(self, work: Callable, body) -> dict:
        try:
            return await self._lanes.call(work, body)
        except Exception as exc:
            raise to_api_error(exc) from exc

    async def tokenize(self, body) -> dict:
        """POST /tokenize (vLLM's shapes): a prompt, or chat messages rendered by the chat template."""
        return await self._on_prepare_thread(self._tokenize, body)

    async def detokenize(self, body) -> dict:
        """POST /detokenize: token ids -> text (special tokens kept, as the prompt echo shows them)."""
        return await self._on_prepare_thread(self._detokenize, body)

    # ------------------------------------------------------------------ models, health, metrics
    def _model_card(self, lora: LoRARequest | None = None) -> dict:
        limits = self.limits
        if lora is None:     # the base model's card has no root / parent
            return ModelCard(id=limits.served_name, created=0, max_model_len=limits.max_model_len,
                             dtype=limits.dtype).model_dump(exclude={"root", "parent"})
        return ModelCard(id=lora.name, created=0, max_model_len=limits.max_model_len, dtype=limits.dtype,
                         root=lora.path, parent=limits.served_name).model_dump()

    def models(self) -> dict:
        """GET /v1/models: the base model, then each LoRA adapter served (``parent``: the base model)."""
        adapters = self.limits.lora_adapters.adapters()
        return {"object": "list", "data": [self._model_card(), *map(self._model_card, adapters)]}

    def model(self, model_id: str) -> dict:
        """GET /v1/models/{id}: the card of the model or adapter this name chooses; 404 otherwise."""
        return self._model_card(check_model(model_id, self.limits))

    # ------------------------------------------------------------------ LoRA adapters at run time
    async def load_lora_adapter(self, body) -> str:
        """POST /v1/load_lora_adapter (lora_adapters.py): the adapter is checked by the engine, then served."""
        if self.lora_refusal is not None:
            raise bad_request(self.lora_refusal, param="lora_name")
        table = self.limits.lora_adapters
        lora = adapter_to_load(parse_body(LoadLoraAdapterRequest, body), table, self.limits.aliases)
        try:
            await self.engine.check_lora(lora)
        except Exception as exc:  # noqa: BLE001 - the engine's refusal, named for the field that chose it
            err = to_api_error(exc)
            if err.status == 400 and err.param is None:      # the adapter's own problem: its folder's
                err = bad_request(f"lora_path: {err.message}", param="lora_path")
            raise err from None
        table.put(lora)
        return f"Success: LoRA adapter '{lora.name}' added successfully."

    async def unload_lora_adapter(self, body) -> str:
        """POST /v1/unload_lora_adapter: new requests naming the adapter get 404; running ones finish."""
        if self.lora_refusal is not None:
            raise bad_request(self.lora_refusal, param="lora_name")
        table = self.limits.lora_adapters
        table.remove(adapter_to_unload(parse_body(UnloadLoraAdapterRequest, body), table))
        return f"Success: LoRA adapter '{body['lora_name']}' removed successfully."

    async def check_ready(self) -> None:
        await self.engine.check_ready()

    async def refresh_engine_metrics(self) -> None:
        """The engine replicas' gauges from their last states (a dead engine leaves the last values)."""
        try:
            self.metrics.engine.update(await self.engine.replica_states())
        except Exception:  # noqa: BLE001 - a dead engine must not break /metrics; gauges keep last values
            pass

    async def metrics_text(self) -> bytes:
        await self.refresh_engine_metrics()
        return self.metrics.render()
