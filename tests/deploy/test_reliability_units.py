"""Units of the reliability tooling (no Ray): the fuzz verdict (the oracle of the fuzz test), the fuzz
strategy's coverage, the percentile used for rejection latency, the drain argument checks."""

from __future__ import annotations

import json

import pytest
from helpers.burst_load import percentile
from helpers.fuzz_requests import CHAT, COMPLETIONS, FuzzRequest, fuzz_requests, verdict
from hypothesis import HealthCheck, given, settings
from pagedray.deploy.serve.app import parse_args

ERROR = {"error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}}
INTERNAL = {"error": {"message": "boom", "type": "internal_error", "param": None, "code": None}}
CHUNK = {"choices": [{"index": 0, "text": "x", "finish_reason": None}]}


def sse(*events) -> str:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)


@pytest.mark.parametrize("status, text, stream, expected", [
    (200, '{"choices": []}', False, "ok"),
    (400, json.dumps(ERROR), False, "client_error"),
    (429, json.dumps(ERROR), False, "client_error"),
    (400, "Bad Request", False, "server_error"),                 # not an OpenAI error body
    (404, json.dumps({"detail": "Not Found"}), False, "server_error"),
    (500, json.dumps(INTERNAL), False, "server_error"),
    (503, json.dumps(ERROR), False, "server_error"),
    (200, sse(CHUNK, "[DONE]"), True, "ok"),
    (200, sse(CHUNK, ERROR, "[DONE]"), True, "ok"),              # an in-band 4xx-type error (e.g. 429)
    (200, sse(CHUNK, INTERNAL, "[DONE]"), True, "server_error"),
    (200, sse(CHUNK), True, "server_error"),                     # stream cut without [DONE]
])
def test_verdict(status, text, stream, expected):
    assert verdict(status, text, stream) == expected


def test_percentile_nearest_rank():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 99) == 5.0
    assert percentile(values, 0) == 1.0
    assert percentile(list(range(1, 101)), 99) == 99
    assert percentile([], 50) != percentile([], 50)   # NaN


def test_fuzz_strategy_covers_every_kind_of_body():
    seen = []
    # 1,000 draws: the rarer kinds (NaN literals, streams) are a few percent each, and the draws vary
    # between processes (string hash order), so 300 could miss one

    @settings(max_examples=1000, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(fuzz_requests("m", 1000))
    def collect(request: FuzzRequest):
        seen.append(request)

    collect()
    assert {r.path for r in seen} == {COMPLETIONS, CHAT}
    assert {r.content_type for r in seen} >= {"application/json", "text/plain"}
    decoded, undecodable = [], 0
    for r in seen:
        try:
            decoded.append(json.loads(r.body))
        except ValueError:
            undecodable += 1
    assert undecodable > 0                                  # truncated / invalid UTF-8 bodies
    objects = [d for d in decoded if isinstance(d, dict)]
    assert len(objects) < len(decoded)                      # some top-level non-objects
    assert any(r.stream for r in seen)
    # every request body (one with a prompt or messages) carries max_tokens, so valid ones stay cheap
    requests = [d for d in objects if "prompt" in d or "messages" in d]
    assert requests and all("max_tokens" in d for d in requests)
    assert sum(d["max_tokens"] in (1, 2) for d in requests) > len(requests) // 2
    assert any(b"NaN" in r.body for r in seen)


def test_graceful_shutdown_arg_is_checked():
    assert parse_args({"graceful_shutdown_s": 3}).graceful_shutdown_s == 3
    for bad in (0, -1, 10**6):
        with pytest.raises(ValueError, match="graceful_shutdown_s"):
            parse_args({"graceful_shutdown_s": bad})
