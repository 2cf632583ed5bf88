"""Hypothesis strategies for fuzzing the OpenAI HTTP API, and the verdict on one response.

Used by tests/deploy/test_abuse_serve.py (against the real running app) and by benchmarks/reliability.py.
Needs ``hypothesis`` (a test dependency); nothing in the server imports this module.

Decisions:
- Every generated request keeps generation tiny: ``max_tokens`` (and ``max_completion_tokens``) is
  always sent, either a valid 1 or 2 or a garbage value; without it a valid chat request would run
  to the end of the context. Prompts are short, ``n`` <= 2 and batches <= 2 prompts, so a valid
  request costs a few decode steps.
- A body is one of: every field valid; one field replaced by garbage; several fields garbage; a
  non-object JSON value; the serialised bytes mutated (truncated, an invalid UTF-8 byte inserted,
  a NaN literal spliced in); or a wrong Content-Type. About one in six comes out valid (200).
- Garbage is any JSON value: nested lists and objects, huge integers, NaN / Infinity floats (Python's
  JSON writes them as literals), arbitrary Unicode text.
- ``run_fuzz`` lets hypothesis generate the examples one by one but sends them from a small thread
  pool: on a 2-core machine a valid request is latency-bound (a few engine steps through Ray), so
  4 at a time cut the wall time about in half. Failures are collected with their request (no
  shrinking); with concurrency a valid request may also get a 429 (queue full), which is a 4xx.
- Verdict: ``server_error`` for a 5xx status, an error body that is not OpenAI-shaped, or a stream
  carrying an in-band error of type ``internal_error`` (an engine failure mid-stream); otherwise
  ``ok`` (2xx) or ``client_error`` (4xx).
"""

from __future__ import annotations

import collections
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from hypothesis import strategies as st

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
WORDS = ("Hello", "The capital of France is", "def f(x):", "Once upon a time", "1 2 3", "ü ñ 漢字 🙂")


@dataclass(frozen=True)
class FuzzRequest:
    path: str
    body: bytes
    content_type: str
    stream: bool   # whether the body asked for SSE (then the response body is read as a stream)


def garbage() -> st.SearchStrategy:
    """Any JSON value, small: scalars of every type (huge ints, NaN, +-inf) nested up to a few levels."""
    scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=2**62, max_value=2**80)
               | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


def _prompt(vocab_size: int) -> st.SearchStrategy:
    token_ids = st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=4)
    return (st.sampled_from(WORDS) | token_ids | st.lists(st.sampled_from(WORDS), min_size=1, max_size=2)
            | st.lists(token_ids, min_size=1, max_size=2))


def _messages() -> st.SearchStrategy:
    text = st.sampled_from(WORDS)
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                     "content": text | st.just([{"type": "text", "text": "Hi"}])})
    return st.lists(message, min_size=1, max_size=2).map(
        lambda ms: ms[:-1] + [{"role": "user", "content": ms[-1]["content"]}])


def _sampling_fields(model: str) -> dict[str, st.SearchStrategy]:
    """Optional fields with valid values (each may be left out)."""
    return {
        "model": st.just(model), "temperature": st.sampled_from([0, 0.0, 0.7, 1.0]),
        "top_p": st.sampled_from([0.5, 1.0]), "top_k": st.sampled_from([-1, 0, 5]),
        "min_p": st.sampled_from([0.0, 0.1]), "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.sampled_from([1.0, 1.2]),
        "seed": st.integers(-(2**63), 2**63 - 1), "stop": st.sampled_from(["\n", ["x", "."]]),
        "stop_token_ids": st.lists(st.integers(0, 100), max_size=2), "n": st.integers(1, 2),
        "ignore_eos": st.booleans(), "stream": st.booleans(),
        "stream_options": st.just({"include_usage": True}), "user": st.text(max_size=8),
    }


def _valid_fields(endpoint: str, model: str, vocab_size: int) -> dict[str, st.SearchStrategy]:
    fields = _sampling_fields(model)
    if endpoint == COMPLETIONS:
        fields.update(prompt=_prompt(vocab_size), logprobs=st.integers(0, 2), echo=st.booleans(),
                      prompt_logprobs=st.integers(0, 2))
    else:
        fields.update(messages=_messages(), logprobs=st.booleans(), top_logprobs=st.integers(0, 2),
                      max_completion_tokens=st.integers(1, 2))
    return fields


@st.composite
def _object_body(draw, endpoint: str, model: str, vocab_size: int) -> dict:
    fields = _valid_fields(endpoint, model, vocab_size)
    required = "prompt" if endpoint == COMPLETIONS else "messages"
    chosen = draw(st.lists(st.sampled_from(sorted(fields)), max_size=5, unique=True))
    body = {name: draw(fields[name]) for name in {required, *chosen}}
    body["max_tokens"] = draw(st.sampled_from([1, 1, 2]))
    broken = draw(st.sampled_from([0, 1, 2, 2, 3, 3]))   # how many fields become garbage
    names = sorted(body) + ["unknown_field"]
    for name in draw(st.lists(st.sampled_from(names), min_size=broken, max_size=broken)):
        body[name] = draw(garbage())
    if draw(st.booleans()) and draw(st.booleans()) and required in body:
        del body[required]
    return body


def _mutate(data: bytes, how: str, where: int) -> bytes:
    cut = where % (len(data) + 1)
    if how == "truncate":
        return data[:cut]
    if how == "invalid_utf8":
        return data[:cut] + b"\xff\xc0" + data[cut:]
    return data.replace(b'"max_tokens": ', b'"max_tokens": 1, "temperature": NaN, "x": ', 1)


@st.composite
def fuzz_requests(draw, model: str, vocab_size: int) -> FuzzRequest:
    """One request for /v1/completions or /v1/chat/completions (see the module docstring)."""
    endpoint = draw(st.sampled_from([COMPLETIONS, COMPLETIONS, CHAT]))
    kind = draw(st.sampled_from(["object"] * 6 + ["not_object", "mutated", "content_type"]))
    body = draw(garbage()) if kind == "not_object" else draw(_object_body(endpoint, model, vocab_size))
    data = json.dumps(body).encode()  # NaN / Infinity become literals
    content_type = "application/json"
    if kind == "mutated":
        data = _mutate(data, draw(st.sampled_from(["truncate", "invalid_utf8", "nan"])), draw(st.integers(0, 10**6)))
    elif kind == "content_type":
        content_type = draw(st.sampled_from(["text/plain", "application/x-www-form-urlencoded", "application/xml"]))
    stream = isinstance(body, dict) and body.get("stream") is True
    return FuzzRequest(endpoint, data, content_type, stream)


def is_openai_error(payload) -> bool:
    error = payload.get("error") if isinstance(payload, dict) else None
    return (isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
            and isinstance(error["message"], str) and bool(error["message"]))


def verdict(status: int, text: str, stream: bool) -> str:
    """``ok`` | ``client_error`` | ``server_error`` for one response (see the module docstring)."""
    if status >= 500:
        return "server_error"
    if status >= 400:
        try:
            payload = json.loads(text)
        except ValueError:
            return "server_error"
        return "client_error" if is_openai_error(payload) else "server_error"
    if stream:
        from pagedray.deploy.openai.sse import parse_sse

        events = parse_sse(text)
        if not events or events[-1] != "[DONE]":
            return "server_error"
        if any(is_openai_error(e) and e["error"]["type"] == "internal_error" for e in events):
            return "server_error"
    return "ok"


@dataclass
class FuzzReport:
    tally: collections.Counter = field(default_factory=collections.Counter)   # verdict -> count
    statuses: collections.Counter = field(default_factory=collections.Counter)
    failures: list[tuple[FuzzRequest, int, str]] = field(default_factory=list)   # server errors


def run_fuzz(client, model: str | None, vocab_size: int, examples: int, concurrency: int = 4) -> FuzzReport:
    """POST ``examples`` generated requests with ``client`` (an httpx.Client with base_url and auth)."""
    from hypothesis import HealthCheck, given, settings

    report, lock = FuzzReport(), threading.Lock()

    def send(request: FuzzRequest) -> None:
        response = client.post(request.path, content=request.body, headers={"content-type": request.content_type})
        outcome = verdict(response.status_code, response.text, request.stream)
        with lock:
            report.tally[outcome] += 1
            report.statuses[response.status_code] += 1
            if outcome == "server_error":
                report.failures.append((request, response.status_code, response.text[:500]))

    with ThreadPoolExecutor(concurrency, thread_name_prefix="fuzz") as pool:
        futures = []

        @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(fuzz_requests(model, vocab_size))
        def one(request: FuzzRequest) -> None:
            futures.append(pool.submit(send, request))

        one()
        for future in futures:
            future.result()   # re-raises a transport error (e.g. the connection was dropped)
    return report
