"""Fault isolation in the ingress (issue #32): one client's big request must not hold another client's
short one, nor /health. Against a TEST DOUBLE engine (fake_engine.py) and gated doubles (gates.py):
the tests hold the big work on a gate and show that the short work completes meanwhile; no timings.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi.testclient import TestClient
from helpers.bad_requests import assert_openai_error
from helpers.fake_engine import ScriptedEngine
from helpers.gates import GatedFormatter, GatedTokenizer, on_event_loop
from pagedray.deploy.http import routes as api
from pagedray.deploy.http.routes import create_api
from pagedray.deploy.openai.metrics import ServerMetrics
from pagedray.deploy.openai.prepare_lanes import BULK_PREPARE_THREADS, SMALL_INPUT
from pagedray.deploy.openai.prompt_bound import max_prompt_chars
from pagedray.deploy.openai.service import OpenAIService
from pagedray.deploy.openai.sse import parse_sse
from pagedray.deploy.openai.validation import ModelLimits

MODEL = "fake-model"
VOCAB = 49152
MAX_MODEL_LEN = 8192   # room for prompts above SMALL_INPUT characters


def make_service(tokenizer, max_model_len: int = MAX_MODEL_LEN) -> OpenAIService:
    limits = ModelLimits(MODEL, frozenset({MODEL}), VOCAB, max_model_len, max_prompt_chars(tokenizer, max_model_len))
    script = getattr(tokenizer, "inner", tokenizer).encode(" The quick brown fox")   # not through a gated double
    engine = ScriptedEngine(script, eos_token_id=tokenizer.eos_token_id)
    return OpenAIService(engine, tokenizer, limits, ServerMetrics(MODEL))


def asgi_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def test_short_requests_are_served_while_every_bulk_thread_holds_a_big_prompt(tokenizer):
    """BULK_PREPARE_THREADS + 1 big prompts: that many are tokenized at once, each by its own tokenizer
    copy; meanwhile a short completion, chat and /tokenize complete. (With one prepare thread the second
    big prompt never starts, and the short requests wait behind it.)"""
    gated = GatedTokenizer(tokenizer)
    service = make_service(gated)
    big = "SLOW " + "word " * (SMALL_INPUT // 5 + 1)
    assert SMALL_INPUT < len(big) <= service.limits.max_prompt_chars

    async def scenario():
        async with asgi_client(create_api(service)) as client:
            bigs = [asyncio.create_task(client.post(path, json=body)) for path, body in
                    [("/v1/completions", {"prompt": big, "max_tokens": 1})] * BULK_PREPARE_THREADS
                    + [("/tokenize", {"prompt": big})]]
            try:
                all_held = await asyncio.to_thread(gated.gate.wait_entered, BULK_PREPARE_THREADS)
                assert all_held, f"only {len(gated.gate.holders)} big prompt(s) tokenized at once"
                short = [await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}),
                         await client.post("/v1/chat/completions",
                                           json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
                         await client.post("/tokenize", json={"prompt": "Hi"})]
                held_meanwhile = len(gated.gate.holders)
            finally:
                gated.release.set()
            return short, held_meanwhile, await asyncio.gather(*bigs)

    short, held_meanwhile, bigs = asyncio.run(scenario())
    assert [r.status_code for r in short] == [200, 200, 200], [r.text for r in short]
    assert held_meanwhile == BULK_PREPARE_THREADS   # the third big prompt was still queued
    assert [r.status_code for r in bigs] == [200] * (BULK_PREPARE_THREADS + 1)
    assert gated.on_event_loop == [False] * (BULK_PREPARE_THREADS + 1)
    held_by = [holder.copy_no for holder in gated.gate.holders[:BULK_PREPARE_THREADS]]
    assert 0 not in held_by and len(set(held_by)) == BULK_PREPARE_THREADS   # one tokenizer copy per thread


def _gated_service(tokenizer) -> tuple[OpenAIService, GatedFormatter]:
    service = make_service(tokenizer)
    service.logprob_format = formatter = GatedFormatter(service.logprob_format)
    return service, formatter


@pytest.mark.parametrize("stream", [False, True])
def test_health_answers_while_big_prompt_logprobs_are_built(tokenizer, monkeypatch, stream):
    """400 prompt tokens x 21 logprobs x n=3: formatted once (off the event loop) while /health answers,
    and the response's JSON is encoded off the event loop too."""
    service, formatter = _gated_service(tokenizer)
    encoded_on_loop = []

    def recording_json_bytes(content):
        encoded_on_loop.append(on_event_loop())
        return json_bytes(content)

    json_bytes = getattr(api, "json_bytes", None)
    monkeypatch.setattr(api, "json_bytes", recording_json_bytes, raising=False)
    prompt = [5 + i % 500 for i in range(400)]
    body = {"prompt": prompt, "prompt_logprobs": 20, "n": 3, "max_tokens": 1, "stream": stream}

    async def scenario():
        async with asgi_client(create_api(service)) as client:
            slow = asyncio.create_task(client.post("/v1/completions", json=body))
            try:
                await asyncio.to_thread(formatter.gate.entered.wait, 120)
                health = await client.get("/health")   # answered while the logprobs are being built
            finally:
                formatter.gate.release.set()
            return health, await slow

    health, slow = asyncio.run(scenario())
    assert formatter.gate.on_event_loop == [False] and formatter.prompt_logprobs_calls == 1   # once for n=3
    assert health.status_code == 200 and slow.status_code == 200, slow.text
    if stream:
        events = [e for e in parse_sse(slow.text) if e != "[DONE]"]
        assert all("error" not in e for e in events), events
        choices = [c for e in events for c in e["choices"] if c.get("prompt_logprobs") is not None]
    else:
        choices = slow.json()["choices"]
        assert encoded_on_loop == [False]
    assert sorted(c["index"] for c in choices) == [0, 1, 2]
    assert all(len(c["prompt_logprobs"]) == len(prompt) and len(c["prompt_logprobs"][1]) >= 1 for c in choices)


def test_prompt_logprobs_are_formatted_once_per_prompt(tokenizer):
    service = make_service(tokenizer)
    calls = []
    inner = service.logprob_format.prompt_logprobs
    service.logprob_format.prompt_logprobs = lambda entries: calls.append(1) or inner(entries)
    client = TestClient(create_api(service))
    body = {"prompt": [[5, 6, 7], [8, 9]], "prompt_logprobs": 2, "n": 3, "max_tokens": 1}
    whole = client.post("/v1/completions", json=body).json()["choices"]
    assert len(calls) == 2 and len(whole) == 6   # 2 prompts x n=3
    assert [len(c["prompt_logprobs"]) for c in whole] == [3, 3, 3, 2, 2, 2]
    assert whole[0]["prompt_logprobs"] == whole[2]["prompt_logprobs"]
    events = parse_sse(client.post("/v1/completions", json={**body, "stream": True}).text)
    firsts = [c for e in events if e != "[DONE]" for c in e["choices"] if c.get("prompt_logprobs")]
    assert len(calls) == 4 and sorted(c["index"] for c in firsts) == list(range(6))


def test_inputs_are_bounded_before_the_tokenizer_sees_them(tokenizer):
    """/tokenize has the completions' character bound; a chat's rendered prompt is checked before it
    is tokenized (content within the bound, template text beyond it)."""
    max_model_len = 64
    gated = GatedTokenizer(tokenizer)
    service = make_service(gated, max_model_len)
    bound = service.limits.max_prompt_chars
    client = TestClient(create_api(service))
    too_long = "SLOW" + "x" * bound
    assert_openai_error(client.post("/tokenize", json={"prompt": too_long}), 400, "prompt")
    per_message = bound // max_model_len - 4   # the content fits; the template's text per message does not
    messages = [{"role": "user", "content": "SLOW" + "y" * per_message} for _ in range(max_model_len)]
    assert sum(len(m["content"]) for m in messages) <= bound
    for path in ("/tokenize", "/v1/chat/completions"):
        assert_openai_error(client.post(path, json={"messages": messages}), 400, "messages")
    assert_openai_error(client.post("/tokenize", json={"messages": [{"role": "user", "content": too_long}]}),
                        400, "messages")
    assert gated.encoded == []   # no tokenizer copy was asked to encode anything
    assert client.post("/tokenize", json={"prompt": "x" * 10}).status_code == 200 and len(gated.encoded) == 1


def test_a_short_body_that_asks_for_a_grammar_takes_the_bulk_lane():
    """A grammar check may spend its whole budget on a 40-character body (``(a{1000}){1000}``): such bodies
    must not queue in front of other clients' short requests."""
    from pagedray.deploy.openai.prepare_lanes import PrepareLanes

    assert PrepareLanes.lane({"prompt": "Hi", "max_tokens": 1}) == "short"
    assert PrepareLanes.lane({"prompt": "x", "structured_outputs": {"regex": "(a{1000}){1000}"}}) == "bulk"
    assert PrepareLanes.lane({"messages": [], "response_format": {"type": "json_object"}}) == "bulk"
    assert PrepareLanes.lane({"messages": [], "tools": [{"type": "function"}]}) == "bulk"
    assert PrepareLanes.lane({"prompt": "Hi", "response_format": None}) == "short"
    assert PrepareLanes.lane({"prompt": "x" * (SMALL_INPUT + 1)}) == "bulk"
