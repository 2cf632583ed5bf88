"""SamplingParams: how one request's tokens are chosen and when it stops.

Every field is validated in ``__post_init__``; a bad value raises ValueError naming the field, so
that no request with impossible parameters ever reaches the scheduler. The dataclass is frozen and
travels to the workers inside a StepPlan (see ``wire.py``) as a plain dict.

Conventions (settled here, shared by the Sampler and the scheduler):
- ``temperature == 0`` means greedy (argmax); other sampling knobs are then ignored. At most
  ``MAX_TEMPERATURE``; ``repetition_penalty`` lies in ``REPETITION_PENALTY_RANGE`` (values outside
  underflow or overflow in float32: see those constants).
- ``top_k <= 0`` disables top-k (``-1`` is accepted as the OpenAI/vLLM spelling of "off").
- ``logprobs=None``: no logprobs; ``logprobs=k`` (k >= 0): the sampled token's logprob plus the
  top-k alternatives.
- ``prompt_logprobs=k`` (k >= 0): every prompt token after the first also gets its logprob, rank and
  the top-k alternatives at its position (workers/runner/prompt_logprobs.py). Such a request does not read
  the prefix cache: cached positions would have no logits.
- ``seed``: sampling for this sequence depends only on (seed, position), never on the batch.
- ``repetition_penalty`` applies to prompt and output tokens; presence/frequency penalties apply to
  output tokens only (the OpenAI definition).
- ``min_tokens``: until a sequence has that many output tokens, EOS and ``stop_token_ids`` cannot be
  sampled (their logits are -inf) and no stop rule ends it (vLLM's rule); ``max_tokens`` still does.
- ``logit_bias``: ``(token_id, bias)`` pairs added to the logits before penalties, temperature and
  filters (the OpenAI definition; bias in [-100, 100]). Logprobs stay those of the raw logits.
- ``grammar``: an llguidance grammar; rank 0 masks every token it does not allow next
  (workers/sampling/grammar.py).
- ``speculative``: False opts this request out of speculative decoding (the engine's
  ``num_speculative_tokens``); its output is the same either way.
- ``pooling``: "last" or "mean": a pooling request (embeddings, scores; workers/runner/pooling.py). Its result is
  the model's final hidden state (after the last norm) at the last prompt position, or its mean over the
  prompt's positions, plus with ``pooling_token_ids`` the logits of those tokens at the last prompt position
  (a yes/no reranker's score). It runs as a prefill: n=1, and it ends after one token, which is not part of
  the result. "mean" does not read the prefix cache (cached positions have no hidden states).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

MAX_N = 16
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024   # entries per request: bounds the sampler's per-step work for one row
MAX_STOP_TOKEN_IDS = 1024   # the scheduler checks each sampled token against them on the step thread
MAX_GRAMMAR_CHARS = 256 * 1024
POOLING_KINDS = ("last", "mean")
MAX_POOLING_TOKEN_IDS = 64
# Bounds that keep every sampling transform finite in float32 (the Sampler's dtype): a repetition penalty
# of 1e-50 is 0 in float32, and a masked logit (-inf) times 0 is NaN; logits divided by a penalty of
# 1e-40 overflow; a temperature above float32's range is inf, and -inf / inf is NaN. Inside these ranges
# (logits of |x| <= ~1e3, logit_bias included) every product and quotient stays finite.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_TEMPERATURE = 1e4


def _check(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {message}")


INT64_MAX = 2**63 - 1


def _is_int(value: object) -> bool:
    """A plain integer that fits the int64 tensors and msgpack ints it will travel in."""
    return isinstance(value, int) and not isinstance(value, bool) and -INT64_MAX - 1 <= value <= INT64_MAX


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    grammar: str | None = None   # an llguidance grammar (JSON text): workers/sampling/grammar.py
    speculative: bool = True     # False: never propose speculative tokens for this request
    pooling: str | None = None   # "last" / "mean": a pooling request (see the module docstring)
    pooling_token_ids: tuple[int, ...] = field(default_factory=tuple)   # their logits at the last prompt position

    def __post_init__(self) -> None:
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
               f"must be a positive integer, got {self.max_tokens!r}")
        _check(_is_number(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE, "temperature",
               f"must be a number in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and self.top_k >= -1, "top_k",
               f"must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        low, high = REPETITION_PENALTY_RANGE
        _check(_is_number(self.repetition_penalty) and low <= self.repetition_penalty <= high, "repetition_penalty",
               f"must be a number in [{low:g}, {high:g}], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name, f"must be in [-2, 2], got {value!r}")
        _check(self.seed is None or _is_int(self.seed), "seed", f"must be an integer or None, got {self.seed!r}")
        if not isinstance(self.stop_token_ids, tuple):
            _check(isinstance(self.stop_token_ids, (list, tuple)), "stop_token_ids",
                   f"must be a list of token ids, got {self.stop_token_ids!r}")
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must contain non-negative integers")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
               f"at most {MAX_STOP_TOKEN_IDS} ids (each sampled token is checked against them), "
               f"got {len(self.stop_token_ids)}")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", f"must be a bool, got {self.ignore_eos!r}")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        _check(self.prompt_logprobs is None
               or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS), "prompt_logprobs",
               f"must be None or an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        self._normalise_logit_bias()
        _check(self.grammar is None or (isinstance(self.grammar, str) and 0 < len(self.grammar) <= MAX_GRAMMAR_CHARS),
               "grammar", f"must be None or a non-empty string of at most {MAX_GRAMMAR_CHARS} characters")
        _check(isinstance(self.speculative, bool), "speculative", f"must be a bool, got {self.speculative!r}")
        self._check_pooling()

    def _check_pooling(self) -> None:
        _check(self.pooling is None or self.pooling in POOLING_KINDS, "pooling",
               f"must be None or one of {POOLING_KINDS}, got {self.pooling!r}")
        if not isinstance(self.pooling_token_ids, tuple):
            _check(isinstance(self.pooling_token_ids, list), "pooling_token_ids",
                   f"must be a list of token ids, got {self.pooling_token_ids!r}")
            object.__setattr__(self, "pooling_token_ids", tuple(self.pooling_token_ids))
        _check(all(_is_int(t) and t >= 0 for t in self.pooling_token_ids)
               and len(self.pooling_token_ids) <= MAX_POOLING_TOKEN_IDS, "pooling_token_ids",
               f"must hold at most {MAX_POOLING_TOKEN_IDS} non-negative token ids")
        _check(not self.pooling_token_ids or self.pooling is not None, "pooling_token_ids", "only with pooling")
        if self.pooling is not None:
            _check(self.n == 1, "n", f"a pooling request has one result: n must be 1, got {self.n}")

    def _normalise_logit_bias(self) -> None:
        bias = self.logit_bias
        _check(isinstance(bias, (list, tuple)) and len(bias) <= MAX_LOGIT_BIAS, "logit_bias",
               f"must be at most {MAX_LOGIT_BIAS} (token_id, bias) pairs")
        pairs = []
        for pair in bias:
            _check(isinstance(pair, (list, tuple)) and len(pair) == 2, "logit_bias",
                   f"must be (token_id, bias) pairs, got {pair!r}")
            token_id, value = pair
            _check(_is_int(token_id) and token_id >= 0, "logit_bias",
                   f"token ids must be integers >= 0, got {token_id!r}")
            _check(_is_number(value) and -100 <= value <= 100, "logit_bias",
                   f"biases must be numbers in [-100, 100], got {value!r}")
            pairs.append((token_id, float(value)))
        _check(len({t for t, _ in pairs}) == len(pairs), "logit_bias", "a token id appears twice")
        object.__setattr__(self, "logit_bias", tuple(pairs))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["stop_token_ids"] = list(self.stop_token_ids)
        out["logit_bias"] = [list(pair) for pair in self.logit_bias]
        out["pooling_token_ids"] = list(self.pooling_token_ids)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> SamplingParams:
        return cls(**data)
