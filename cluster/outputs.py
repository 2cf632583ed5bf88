"""What the engine hands back to its callers (the offline LLM API, the Serve engine deployment).

Outputs are streamed as deltas: each RequestOutput carries, per sample, only the tokens generated
since the previous output of the same request. The first output of a request also carries the
prompt token ids (and their logprobs when ``prompt_logprobs`` was asked for). Exactly one output per
request has ``finished=True``, and it is the last.

Finish reasons: "stop" (EOS or a stop token id; the ingress also uses it for stop strings),
"length" (max_tokens or max_model_len reached), "abort" (cancelled by the caller),
"error" (the engine failed while the request was in flight; ``error`` says why).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    # (token_id, logprob) pairs, best first
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    # 1 + the number of tokens more likely than this one (prompt logprobs only)
    rank: int | None = None


@dataclass(slots=True)   # one per request and step: slots make it cheaper to build
class CompletionOutput:
    index: int
    # tokens generated since this sample's previous output
    token_ids: list[int] = field(default_factory=list)
    # one entry per token in token_ids when the request asked for logprobs, else None
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    finished: bool
    prompt_token_ids: list[int] | None = None
    error: str | None = None
    num_cached_prompt_tokens: int = 0
    # with the prompt token ids when the request asked for prompt logprobs: one entry per prompt
    # token, None for the first (nothing predicts it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # the request ended with ``error`` because its engine failed (dead, stalled), not through anything of
    # its own: another replica may continue it (deploy/serve/failover.py)
    engine_failed: bool = False
    # KV blocks the request's samples have held so far, integrated over time (usage.kv_block_seconds)
    kv_block_seconds: float = 0.0
    # a request handed over by a replica that Serve removes or that moves it: its blocks (a KVExport; n > 1: a
    # tuple with one per sample, None for a finished one), which its continuations on other replicas import
    # instead of computing them (deploy/serve/failover.py)
    kv: object | None = None
    # the request was moved on purpose (rebalancing: ``AsyncEngine.hand_over``) from the replica with this id; its
    # continuation goes to another replica and is not a failover (deploy/serve/failover.py)
    moved_from: str | None = None
    # a pooling request's result (params.pooling), on its finished output: the pooled final hidden state
    # (floats, not normalized) and the logits of its pooling_token_ids at the last prompt position
    pooled: list[float] | None = None
    pooled_logits: list[float] | None = None


def merge_deltas(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One delta carrying both: per sample, ``first``'s tokens (and logprobs) then ``later``'s; the
    later finish state, error and finish reasons; the first output's prompt fields."""
    merged = {out.index: CompletionOutput(out.index, list(out.token_ids),
                                          None if out.logprobs is None else list(out.logprobs), out.finish_reason)
              for out in first.outputs}
    for out in later.outputs:
        into = merged.setdefault(out.index, CompletionOutput(out.index))
        into.token_ids += out.token_ids
        if out.logprobs is not None:
            into.logprobs = (into.logprobs or []) + list(out.logprobs)
        into.finish_reason = out.finish_reason or into.finish_reason
    return RequestOutput(first.request_id, [merged[i] for i in sorted(merged)], later.finished,
                         first.prompt_token_ids or later.prompt_token_ids, later.error or first.error,
                         max(first.num_cached_prompt_tokens, later.num_cached_prompt_tokens),
                         first.prompt_logprobs or later.prompt_logprobs,
                         kv_block_seconds=max(first.kv_block_seconds, later.kv_block_seconds),
                         kv=later.kv or first.kv, moved_from=later.moved_from or first.moved_from,
                         pooled=later.pooled or first.pooled, pooled_logits=later.pooled_logits or first.pooled_logits)


class EngineError(RuntimeError):
    """Base class for errors the engine raises to callers."""


class QueueFullError(EngineError):
    """The bounded admission queue is full: retry later (HTTP 429)."""


class EngineDeadError(EngineError):
    """The engine or one of its TP ranks has failed; in-flight requests end with finish_reason 'error'."""


class EngineDrainingError(EngineError):
    """The engine is shutting down and accepts no new requests (HTTP 503)."""
